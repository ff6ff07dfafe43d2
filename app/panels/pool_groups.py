"""KV-cache groups in the pool view (a model with more than one group; one group shows nothing
of this): a mark over the state colour of each sliding-window group's blocks, a filter that
fades every block outside the chosen group, and each group's counts for the title.

A block's group is the one that last allocated it (Snapshot.block_group), shown only while the
block holds KV: held, or cached (a released sliding-window block keeps its hash). A free block
holds nothing of any group: it has no mark, and the filter fades it with the other groups'.

The marks and the fade are two images over the cells (one drawImage each, as the cells'), never
an item per cell: a mark is a white corner triangle, 5/8 of a cell on each side, drawn on a grid of
mark_subcells² pixels per cell, one corner per sliding-window group (full attention has none)."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QComboBox

from kvscope.engine.kv_groups import SLIDING
from kvscope.engine.snapshot import ACTIVE, CACHED, FREE, SHARED, Snapshot

NO_GROUP = -1
MARK_GLYPHS = ("◤", "◥", "◣", "◢")  # the corners marked, one per sliding window, in order
MARK_RGBA = (255, 255, 255, 255)
FADE_RGBA = (255, 255, 255, 200)  # over the cells of the groups not chosen
ALL_GROUPS = "All groups"


def block_groups(s: Snapshot) -> np.ndarray:
    """Each block's group (int16), NO_GROUP for a free block (sessions from before groups:
    every block of group 0)."""
    group = s.block_group.astype(np.int16)
    if len(group) != s.num_blocks:
        group = np.zeros(s.num_blocks, dtype=np.int16)
    group[s.state == FREE] = NO_GROUP
    return group


def group_counts(s: Snapshot) -> list[tuple[int, int, int]]:
    """(active, shared, cached) blocks of each group."""
    group = block_groups(s)
    held = (s.state == ACTIVE) | (s.state == SHARED)
    return [(int((held & (group == g)).sum()), int(((s.state == SHARED) & (group == g)).sum()),
             int(((s.state == CACHED) & (group == g)).sum())) for g in range(len(s.groups))]


def groups_line(names, counts, chosen: int | None, form: int) -> str:
    """The title's line of group counts: every group's (form 2, the narrowest: active only), or
    the chosen group's alone."""
    if chosen is not None:
        a, sh, c = counts[chosen]
        return (f"{names[chosen]}: {a} active ({sh} shared) · {c} cached"
                + ("" if form == 2 else " · the other groups faded"))
    if form == 2:
        return " · ".join(f"{n}: {a} active" for n, (a, _, _) in zip(names, counts, strict=True))
    return " · ".join(f"{n}: {a} active, {c} cached"
                      for n, (a, _, c) in zip(names, counts, strict=True))


def explain_group(group) -> str:
    """A sentence on a block's group, for the details panel."""
    layers = f"{len(group.layers)} layers" if group.layers else "every layer"
    if group.kind != SLIDING:
        return (f"Its KV-cache group, {group.name} ({layers}), keeps every block of a request's "
                "table while the request runs.")
    return (f"Its KV-cache group, {group.name} ({layers}), attends only the last "
            f"{group.window} tokens: a request's blocks wholly before the window leave its table "
            "(∅) while it runs, and stay cached until evicted.")


def mark_index(groups) -> np.ndarray:
    """Per group, its mark in MARKS (-1: none, full attention): sliding windows in order."""
    marks = np.full(len(groups), -1, dtype=np.int16)
    windows = [g for g, group in enumerate(groups) if group.kind == SLIDING]
    marks[windows] = np.arange(len(windows)) % len(MARK_GLYPHS)
    return marks


def mark_subcells(num_blocks: int) -> int:
    """The mark's grid per cell: fine where cells are large enough to show it (smooth edges),
    coarse in a pool of tiny cells (the image stays small)."""
    return 16 if num_blocks <= 4096 else 8 if num_blocks <= 32768 else 4


def mark_patterns(k: int) -> np.ndarray:
    """bool [1 + len(MARK_GLYPHS), k, k]: no mark, then each corner's triangle."""
    i, j = np.mgrid[:k, :k]
    corner = i + j < k * 5 // 8
    return np.stack([np.zeros((k, k), bool), corner, corner[:, ::-1], corner[::-1, :],
                     corner[::-1, ::-1]])


def _lut(rgba) -> np.ndarray:
    lut = np.zeros((2, 4), dtype=np.uint8)
    lut[1] = rgba
    return lut


class GroupFilter(QComboBox):
    """All groups, or one group: the others fade. Shown only for a model with several groups;
    a model with other groups starts again from All."""

    group_chosen = Signal(object)  # group index or None (all)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.groups: tuple = ()
        self.setToolTip("Show one KV-cache group at full strength: the blocks of the other groups "
                        "(and free blocks) fade, and the title counts that group")
        self.setSizeAdjustPolicy(QComboBox.AdjustToContents)
        self.setFocusPolicy(Qt.StrongFocus)
        self.currentIndexChanged.connect(lambda i: self.group_chosen.emit(self.chosen))
        self.hide()

    @property
    def chosen(self) -> int | None:
        return None if self.currentIndex() <= 0 else self.currentIndex() - 1

    def set_groups(self, groups: tuple) -> bool:
        """Returns whether the groups changed (the filter then shows All)."""
        if groups == self.groups:
            return False
        self.groups = groups
        self.blockSignals(True)
        self.clear()
        self.addItems([ALL_GROUPS, *(g.name for g in groups)])
        self.setCurrentIndex(0)
        self.blockSignals(False)
        self.setVisible(len(groups) > 1)
        return True


class GroupLayers:
    """The marks and the fade over a pool view's cells (items of its plot)."""

    def __init__(self, plot):
        self.marks = pg.ImageItem(axisOrder="row-major")
        self.marks.setLookupTable(_lut(MARK_RGBA))
        self.marks.setZValue(2.5)  # over the outlines (a selected block keeps its mark)
        self.fade = pg.ImageItem(axisOrder="row-major")
        self.fade.setLookupTable(_lut(FADE_RGBA))
        self.fade.setZValue(2.7)  # over everything of the groups not chosen
        for item in (self.marks, self.fade):
            plot.addItem(item)
        self._marks_key: tuple | None = None
        self._fade_key: tuple | None = None

    def show(self, s: Snapshot | None, cols: int, chosen: int | None) -> None:
        """Redrawn only when a block's mark (or the faded blocks) changed."""
        several = s is not None and len(s.groups) > 1
        group = block_groups(s) if several else None
        rows = 0 if s is None else -(-s.num_blocks // cols)
        if several:
            mark = np.where(group >= 0, mark_index(s.groups)[group], -1)
            key = (cols, mark.tobytes())
        else:
            key = None
        if key != self._marks_key:
            self._marks_key = key
            self._draw_marks(None if key is None else mark, cols, rows)
        fade_key = None if not several or chosen is None else (cols, chosen, group.tobytes())
        if fade_key != self._fade_key:
            self._fade_key = fade_key
            if fade_key is None:
                self.fade.clear()
            else:
                grid = np.ones(rows * cols, dtype=np.uint8)  # the pad too: past the pool
                grid[: s.num_blocks] = group != chosen
                self.fade.setImage(grid.reshape(rows, cols), autoLevels=False, levels=(0, 1))

    def _draw_marks(self, mark: np.ndarray | None, cols: int, rows: int) -> None:
        if mark is None or not (mark >= 0).any():
            self.marks.clear()
            return
        k = mark_subcells(len(mark))
        grid = np.full(rows * cols, -1, dtype=np.int16)
        grid[: len(mark)] = mark
        cells = mark_patterns(k)[grid + 1].reshape(rows, cols, k, k)  # -1 (none): no mark
        image = cells.transpose(0, 2, 1, 3).reshape(rows * k, cols * k).astype(np.uint8)
        self.marks.setImage(image, autoLevels=False, levels=(0, 1))
        self.marks.setRect(0, 0, cols, rows)
