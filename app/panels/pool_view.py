"""The block pool: every physical block a cell of one ImageItem over a uint8 display-code array.

Selected blocks (the selected request's table, or a clicked block) get an outline drawn by one
ScatterPlotItem of hollow squares: an outline, never a new fill colour; so do the blocks evicted
during the step shown, in vermilion. Cells of 4 px or more are drawn 1 px apart. A model with
several KV-cache groups gets their marks, a group filter and counts (pool_groups). A host
tier's pool is a second grid below the device's, an attached server's tiers below its GPU one grid
each (pool_host)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QEvent, Qt, Signal
from PySide6.QtGui import QFont, QFontMetricsF
from PySide6.QtWidgets import QHBoxLayout, QLabel, QSizePolicy, QVBoxLayout, QWidget

from kvscope.app import palette
from kvscope.app.frames import Frame
from kvscope.app.panels.pool_groups import (
    MARK_GLYPHS,
    GroupFilter,
    GroupLayers,
    group_counts,
    groups_line,
    mark_index,
)
from kvscope.app.panels.pool_host import (
    HOST_TIP,
    TIER_TIP,
    HostGrid,
    TierGrids,
    describe_host_block,
    grid_lines,
)
from kvscope.app.panels.pool_text import TITLE_TIP, describe_block, pool_title
from kvscope.app.selection import Selection
from kvscope.engine.snapshot import Snapshot

GAP_MIN_PX = 4  # cells at least this wide get a 1 px gap between them


def grid_columns(num_blocks: int, aspect: float = 1.5) -> int:
    """Columns that make square cells fill a view of this width/height ratio."""
    return int(min(512, max(8, round(np.sqrt(num_blocks * max(aspect, 0.2))))))


class PoolView(QWidget):
    block_clicked = Signal(object)  # block id

    def __init__(self, selection: Selection | None = None, parent=None):
        super().__init__(parent)
        self.selection = selection or Selection()
        self.selection.request_changed.connect(self._on_selection)
        self.selection.blocks_changed.connect(self._on_selection)
        self.selection.host_blocks_changed.connect(lambda b: self.tier_grids.select(b))
        self.plot = pg.PlotWidget(background="w", enableMenu=False)
        self.plot.setAspectLocked(True)
        self.plot.hideAxis("left")
        self.plot.hideAxis("bottom")
        self.plot.invertY(True)
        self.image = pg.ImageItem(axisOrder="row-major")
        self.image.setLookupTable(palette.make_lut())
        self.image.setLevels([0, 255])
        self.plot.addItem(self.image)
        self.outline = pg.ScatterPlotItem(symbol="s", brush=None, pxMode=False, size=0.82,
                                          pen=pg.mkPen(palette.SELECTED_OUTLINE, width=2))
        self.plot.addItem(self.outline)
        self.evicted_outline = pg.ScatterPlotItem(symbol="s", brush=None, pxMode=False,
                                                  size=0.94,
                                                  pen=pg.mkPen(palette.EVICTED_COLOR, width=2))
        self.plot.addItem(self.evicted_outline)
        self.gaps = pg.PlotCurveItem(pen=pg.mkPen("w", width=1), connect="pairs")
        self.gaps.setZValue(1)  # over the cells, under the outlines
        # Kept as pixels until the grid or the zoom changes: stroking its 260 lines cost 2 ms
        # on every frame, as the cells under it change.
        self.gaps.setCacheMode(self.gaps.CacheMode.DeviceCoordinateCache)
        self.outline.setZValue(2)
        self.evicted_outline.setZValue(2)
        self.plot.addItem(self.gaps)
        self._gaps_key: tuple | None = None
        self.plot.plotItem.vb.sigRangeChanged.connect(self._draw_gaps)
        self.dead_outline = pg.ScatterPlotItem(
            symbol="s", brush=None, pxMode=False, size=0.6,
            pen=pg.mkPen(palette.DEAD_OUTLINE, width=2, style=Qt.DashLine))
        self.dead_outline.setZValue(2)
        self.plot.addItem(self.dead_outline)
        self.tier_grids = TierGrids(self.plot)
        self.host_grid = self.tier_grids.grids[0]  # the host tier's (the first below)
        self.dead: np.ndarray = np.zeros(0, dtype=np.int64)
        self.title = QLabel("<b>Block pool</b>")
        self.title.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        self.title.setToolTip(TITLE_TIP)
        self.group_filter = GroupFilter()
        self.group_filter.group_chosen.connect(self._on_group_chosen)
        self.group_layers = GroupLayers(self.plot)
        self._title_form = 0  # pool_title's form that fits the width (see _fit_title)
        self.cell = "block"  # what a cell is called (set_terms)
        self.block_kv = ""  # its format and bytes (set_block_kv)
        self._cached_term = "darker = evicted sooner"  # what cached shades mean (set_terms)
        self.hover_label = QLabel(self._hint())
        self.hover_label.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        self._mouse = None  # where the mouse is over the pool (scene), None: elsewhere
        self.hover_label.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.plot.viewport().installEventFilter(self)  # the hover text clears on leaving
        self.legend = QLabel(self._legend_html())
        self.legend.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        header = QHBoxLayout()
        header.setContentsMargins(0, 0, 0, 0)
        header.addWidget(self.title, 1)
        header.addWidget(self.group_filter)
        layout.addLayout(header)
        layout.addWidget(self.plot, 1)
        layout.addWidget(self.legend)
        layout.addWidget(self.hover_label)
        self.snapshot: Snapshot | None = None
        self.codes = np.zeros(0, dtype=np.uint8)
        self.evicted = np.zeros(0, dtype=np.int64)  # outlined: evicted during the step shown
        self.cols = 16
        self.highlighted: np.ndarray = np.zeros(0, dtype=np.int64)
        self.auto_fit = True  # until the user zooms or pans
        self.plot.plotItem.vb.sigRangeChangedManually.connect(self._on_manual_range)
        self.plot.scene().sigMouseMoved.connect(self._on_mouse_moved)
        self.plot.scene().sigMouseClicked.connect(self._on_mouse_clicked)

    def set_terms(self, cell: str = "block", cached: str = "darker = evicted sooner") -> None:
        """What a cell is called and what the shades of cached mean (attached to a server:
        "hash slot", "darker = stored earlier"; physical block ids are not published)."""
        self.cell, self._cached_term = cell, cached
        self.legend.setText(self._legend_html(cached, self.group_filter.groups,
                                              _engine_host(self.snapshot)))
        self._describe_hovered()

    @staticmethod
    def _legend_html(cached: str = "darker = evicted sooner", groups: tuple = (),
                     host: bool = False) -> str:
        def sw(color, text, glyph="■"):
            return f'<span style="color:{color}; font-size:large;">{glyph}</span>&nbsp;{text}' \
                   "&nbsp;&nbsp;&nbsp;"
        marks = [sw(palette.ACTIVE_COLOR, f"white corner: a block of {g.name}", MARK_GLYPHS[m])
                 for g, m in zip(groups, mark_index(groups).tolist(), strict=True) if m >= 0]
        return "".join([sw("#aaaaaa", "free", "□"), sw(palette.ACTIVE_COLOR, "active"),
                        sw(palette.SHARED_COLOR, "shared (deeper = more owners)"),
                        sw(palette.CACHED_COLOR, f"cached ({cached})"),
                        sw(palette.EVICTED_COLOR, "evicted this step", "□"),
                        sw("#000000", "selected", "□"),
                        sw(palette.DEAD_OUTLINE, "dead: cached, unreachable", "⬚"),
                        *(marks if len(groups) > 1 else []),
                        *([sw(palette.ACTIVE_COLOR, "host tier (the lower grid): loading "
                                                    "back")] if host else [])])

    # ----------------------------------------------------------------- render
    def show_frame(self, frame: Frame) -> None:
        if frame.snapshot is not None:
            self.set_snapshot(frame.snapshot, frame.evicted)
            self.show_dead(frame.dead)
            self._on_selection()

    def clear(self) -> None:
        self.snapshot, self.codes = None, np.zeros(0, dtype=np.uint8)
        self.image.clear()
        self.tier_grids.show(None, self.cols, 0, 0)
        self.highlight(None)
        self.show_dead(None)
        self.evicted = np.zeros(0, dtype=np.int64)
        self.evicted_outline.setData([], [])
        self.title.setText("<b>Block pool</b>")
        self.group_filter.set_groups(())  # hidden until a snapshot names its groups
        self.legend.setText(self._legend_html(self._cached_term))
        self.group_layers.show(None, self.cols, None)
        self._describe_hovered()

    def _on_selection(self, *_) -> None:
        self.highlight(self.selection.highlighted(self.snapshot))

    def set_snapshot(self, snap: Snapshot, evicted: np.ndarray | None = None) -> None:
        resized = self.snapshot is None or _sizes(snap) != _sizes(self.snapshot)
        self.snapshot, self._evicted = snap, evicted
        cols = self.cols
        self.cols = grid_columns(sum(_sizes(snap)), self._aspect())
        rows = -(-snap.num_blocks // self.cols)
        grid = np.full(rows * self.cols, palette.CODE_PAD, dtype=np.uint8)
        self.codes = palette.display_codes(snap)
        grid[: snap.num_blocks] = self.codes
        self.image.setImage(grid.reshape(rows, self.cols), autoLevels=False, levels=(0, 255))
        self.evicted = gone = np.asarray(evicted if evicted is not None else [], dtype=np.int64)
        self.evicted_outline.setData(x=(gone % self.cols) + 0.5, y=(gone // self.cols) + 0.5)
        self._show_host(rows)
        if self.group_filter.set_groups(snap.groups) or resized:  # another model: all groups
            self.legend.setText(self._legend_html(self._cached_term, snap.groups,
                                                  _engine_host(snap)))
            resized = True  # the title's room and lines change
        self.group_layers.show(snap, self.cols, self.group_filter.chosen)
        if resized:
            self._fit_title()
        self._show_title()
        if resized:
            self.auto_fit = True
        if self.auto_fit:
            self.fit()
        if self.cols != cols:
            self._draw_outline()  # the same blocks in other cells
        self._draw_gaps()
        self._describe_hovered()  # the block under the mouse, as it is at this step

    def _show_host(self, rows: int) -> None:
        """The grids of the tiers below the device's `rows`, each gap as tall as its label."""
        lower = self.snapshot.tiers()[1:]
        lower_rows = sum(-(-t.num_blocks // self.cols) + 1 for t in lower)
        size = self.plot.size()
        cell_px = min(size.width() / self.cols, size.height() / max(1, rows + lower_rows))
        self.tier_grids.show(self.snapshot, self.cols, rows, HostGrid.gap_rows(cell_px))

    def _show_title(self) -> None:
        s = self.snapshot
        if s is not None:
            counts = group_counts(s) if len(s.groups) > 1 else None
            title = pool_title(s, len(self.evicted), self._title_form, self.group_filter.chosen,
                               counts)
            tip = self.title.toolTip()
            if tip.startswith(TITLE_TIP):  # (not another source's words: attach's)
                new = TITLE_TIP if not counts else f"{TITLE_TIP}.\n\n" + groups_line(
                    [g.name for g in s.groups], counts, None, 0)  # whatever the form shows
                new += "" if s.host is None else \
                    f".\n\n{TIER_TIP if s.host.medium else HOST_TIP}"
                if new != tip:
                    self.title.setToolTip(new)
            if title != self.title.text():
                lines = self.title.text().count("<br>")
                self.title.setText(title)
                if title.count("<br>") != lines:  # the grid's height changes: now, not later
                    self.layout().activate()

    def _fit_title(self) -> None:
        """Pick the title's form whose widest line fits the width, for counts of as many digits
        as the pool allows: the title keeps its lines while the counts change."""
        s = self.snapshot
        if s is None:
            return
        widest = s.num_blocks
        probe = dataclasses.replace(s, num_free_blocks=widest, num_active_blocks=widest,
                                    num_cached_blocks=widest, num_shared_blocks=widest)
        if s.host is not None:
            n = s.host.num_blocks
            probe.host = dataclasses.replace(s.host, num_free_blocks=n, num_active_blocks=n,
                                             num_cached_blocks=n)
        counts = [(widest,) * 3] * len(s.groups)
        bold = QFont(self.title.font())
        bold.setBold(True)
        margins = self.layout().contentsMargins()
        room = self.width() - margins.left() - margins.right()
        if self.group_filter.isVisibleTo(self):
            room -= self.group_filter.sizeHint().width() + self.layout().spacing()
        metrics, form = QFontMetricsF(bold), 2
        for form in range(3):
            lines = [line for g in (None, *range(len(s.groups) if len(s.groups) > 1 else 0))
                     for line in pool_title(probe, widest, form, g, counts).replace(
                         "<b>", "").replace("</b>", "").split("<br>")]
            if max(metrics.horizontalAdvance(line) for line in lines) <= room:
                break
        if form != self._title_form:
            self._title_form = form
            self._show_title()

    def fit(self) -> None:
        """Show the whole pool (double-click or a new pool size brings this back)."""
        if self.snapshot is not None:
            rows = -(-self.snapshot.num_blocks // self.cols)
            bottom = max(rows, self.tier_grids.bottom)
            self.plot.setRange(xRange=(0, self.cols), yRange=(0, bottom), padding=0.02)

    def _aspect(self) -> float:
        size = self.plot.size()
        return size.width() / max(1, size.height())

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt API
        super().resizeEvent(event)
        self._fit_title()
        if self.snapshot is not None and self.auto_fit:
            if (grid_columns(sum(_sizes(self.snapshot)), self._aspect()) != self.cols
                    or self.snapshot.host is not None):  # (the gap's rows change too)
                self.set_snapshot(self.snapshot, self._evicted)
            self.fit()

    def _draw_gaps(self, *_) -> None:
        """White 1 px lines between cells, while cells are at least GAP_MIN_PX wide."""
        vb = self.plot.plotItem.vb
        (x0, x1), _ = vb.viewRange()
        rows = 0 if self.snapshot is None else -(-self.snapshot.num_blocks // self.cols)
        show = rows > 0 and vb.width() / max(1e-9, x1 - x0) >= GAP_MIN_PX
        grids = self.tier_grids.shown
        key = (self.cols, rows, *((g.top, g.rows) for g in grids)) if show else None
        if key == self._gaps_key:
            return
        self._gaps_key = key
        if not show:
            self.gaps.setData([], [])
            return
        x, y = grid_lines(self.cols, rows)
        for g in grids:
            hx, hy = grid_lines(self.cols, g.rows, g.top)
            x, y = np.concatenate([x, hx]), np.concatenate([y, hy])
        self.gaps.setData(x, y)

    def _on_group_chosen(self, group: int | None) -> None:
        self.group_layers.show(self.snapshot, self.cols, group)
        self._show_title()

    def _on_manual_range(self, *_) -> None:
        self.auto_fit = False

    def highlight(self, blocks) -> None:
        blocks = np.asarray(blocks if blocks is not None else [], dtype=np.int64)
        if not np.array_equal(blocks, self.highlighted):  # called on every frame
            self.highlighted = blocks
            self._draw_outline()

    def show_dead(self, blocks) -> None:
        """Outline dead blocks (None: not known, nothing outlined)."""
        self.dead = np.asarray(blocks if blocks is not None else [], dtype=np.int64)
        self._draw_outline()

    def _draw_outline(self) -> None:
        for item, b in ((self.outline, self.highlighted), (self.dead_outline, self.dead)):
            item.setData(x=(b % self.cols) + 0.5, y=(b // self.cols) + 0.5)

    def cell_center(self, block: int) -> tuple[float, float]:
        """Scene-independent: the view coordinates of a block's cell centre."""
        return (block % self.cols) + 0.5, (block // self.cols) + 0.5

    # --------------------------------------------------------------- interact
    def block_at(self, scene_pos) -> int | None:
        if self.snapshot is None:
            return None
        p = self.plot.plotItem.vb.mapSceneToView(scene_pos)
        col, row = int(np.floor(p.x())), int(np.floor(p.y()))
        block = row * self.cols + col
        if 0 <= col < self.cols and row >= 0 and block < self.snapshot.num_blocks:
            return block
        return None

    def host_block_at(self, scene_pos) -> int | None:
        """The cell of a tier below the device's under a point of the scene, numbered through
        their grids (None: not such a cell)."""
        p = self.plot.plotItem.vb.mapSceneToView(scene_pos)
        return self.tier_grids.cell_at(p.x(), p.y())

    def tier_cell_center(self, tier: int, block: int) -> tuple[float, float]:
        """The view coordinates of a block's cell in the grid of tier `tier` (1: the first below
        the device's)."""
        return self.tier_grids.grids[tier - 1].cell_center(block)

    def _hint(self) -> str:
        return f"hover a {self.cell} for details"

    def set_block_kv(self, text: str) -> None:
        """What every block stores, said in the hover (pool_text.block_kv_text)."""
        self.block_kv = text
        self._describe_hovered()

    def describe(self, block: int) -> str:
        return describe_block(self.snapshot, block, self.cell, self.block_kv)

    def _on_mouse_moved(self, pos) -> None:
        self._mouse = pos
        self._describe_hovered()

    def _describe_hovered(self) -> None:
        """The caption: the block under the mouse in the snapshot shown (a new step or source
        says it anew), else the hint."""
        block = host = None
        if self._mouse is not None:
            block = self.block_at(self._mouse)
            host = None if block is not None else self.host_block_at(self._mouse)
        text = (self.describe(block) if block is not None else
                describe_host_block(self.snapshot, host) if host is not None else self._hint())
        if text != self.hover_label.text():
            self.hover_label.setText(text)

    def eventFilter(self, watched, event) -> bool:  # noqa: N802 - Qt API
        if event.type() == QEvent.Leave:
            self._mouse = None
            self._describe_hovered()
        return False

    def _on_mouse_clicked(self, event) -> None:
        if event.double():
            self.auto_fit = True
            self.fit()
            return
        block = self.block_at(event.scenePos())
        if block is not None:
            self.block_clicked.emit(block)
            self.selection.select_block(block, self.snapshot)
        elif (host := self.host_block_at(event.scenePos())) is not None:
            self.selection.select_host_block(host)


def _sizes(s: Snapshot) -> tuple[int, ...]:
    """(device blocks, each lower tier's blocks)."""
    return tuple(t.num_blocks for t in s.tiers())


def _engine_host(s: Snapshot | None) -> bool:
    """An engine's host tier (not an attached server's tiers) is shown."""
    return s is not None and s.host is not None and not s.host.medium
