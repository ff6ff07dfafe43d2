"""Prefix tree: the real prefix-sharing tree of the pool, coloured by state, sized by ref count.

One ScatterPlotItem for the nodes, one line item for the edges and a few text labels placed
where they do not overlap, so a thousand nodes stay fast and readable: zoomed out, nodes shrink
to dots (cached smallest, shared biggest) and only the longest runs are labelled; zoom with the
wheel and pan to read the rest; double-click fits the tree again."""

from __future__ import annotations

import itertools

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QFontMetricsF
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from kvscope.app import palette
from kvscope.app.frames import Frame
from kvscope.app.prefix_tree import TreeNode, find_runs, make_forest, walk
from kvscope.app.selection import Selection
from kvscope.engine.snapshot import ACTIVE, CACHED, FREE, SHARED, STATE_NAMES, Snapshot

MAX_LABELS = 40
LABEL_MARGIN = 1  # px around a label's text
STATE_BRUSH = {FREE: "#bbbbbb", ACTIVE: palette.ACTIVE_COLOR, SHARED: palette.SHARED_COLOR,
               CACHED: palette.CACHED_COLOR, -1: "#444444"}


def node_text(node: TreeNode, snap: Snapshot) -> str:
    if node.is_root:
        return f"root · {sum(1 for _ in walk([node])) - 1} node(s) below"
    first, last = node.blocks[0], node.blocks[-1]
    span = f"block {first}" if node.count == 1 else f"{node.count} blocks {first}…{last}"
    owners = sorted(r for r, t in snap.block_tables.items() if first in t)
    text = (f"{span} · {STATE_NAMES[node.state]} · ref {node.ref_count} · hit by {node.hits} "
            f"request{'s' if node.hits != 1 else ''}")
    if owners:
        text += " · owners " + " ".join(f"#{r}" for r in owners)
    return text


def label_text(node: TreeNode) -> str:
    return ((f"×{node.count}" if node.count > 1 else "")
            + (f" hit by {node.hits}" if node.hits else "")).strip()


class PrefixTreePanel(QWidget):
    block_clicked = Signal(object)

    def __init__(self, selection: Selection | None = None, parent=None):
        super().__init__(parent)
        self.selection = selection or Selection()
        self.selection.request_changed.connect(self._on_selection)
        self.selection.blocks_changed.connect(self._on_selection)
        self.latest: Snapshot | None = None  # the newest snapshot shown (the tree may lag it)
        self.stale = False  # a snapshot came since the last rebuild began
        self.plot = pg.PlotWidget(background="w")
        self.plot.hideAxis("left")
        self.plot.hideAxis("bottom")
        self.plot.invertY(True)
        self.plot.setMenuEnabled(False)
        self.vb = self.plot.plotItem.vb
        self.edges = pg.PlotCurveItem(pen=pg.mkPen("#9a9a9a", width=1), connect="pairs")
        self.nodes = pg.ScatterPlotItem(pxMode=True, hoverable=True, tip=None)  # ours, in words
        self.outline = pg.ScatterPlotItem(pxMode=True, brush=None, symbol="o",
                                          pen=pg.mkPen(palette.SELECTED_OUTLINE, width=2))
        self.plot.addItem(self.edges)
        self.plot.addItem(self.nodes)
        self.plot.addItem(self.outline, ignoreBounds=True)
        self.info = QLabel("The prefix tree of the pool: hover a node for details; wheel to "
                           "zoom, drag to pan, double-click to fit")
        self.info.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.info.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addWidget(self.plot, 1)
        layout.addWidget(self.info)
        self.labels: list[pg.TextItem] = []
        self._brushes = {state: pg.mkBrush(color) for state, color in STATE_BRUSH.items()}
        self._pens = {True: pg.mkPen("#ffffff"), False: pg.mkPen(None)}
        self.forest: list[TreeNode] = []
        self.flat: list[TreeNode] = []
        self.snapshot: Snapshot | None = None
        self.auto_fit = True  # until the user zooms or pans
        self._xs = self._ys = self._full_size = self._dot_size = np.zeros(0)
        self._slot_px: float | None = None  # pixels per leaf slot the sizes were made for
        self._node_of_block: np.ndarray | None = None  # built on the first highlight
        self._candidates: list[tuple[int, str, float]] = []  # for labels
        self._text_px: dict[str, float] = {}
        self._rebuild = None  # the slices of a rebuild still to run (a generator)
        self._highlighted = np.zeros(0, dtype=np.int64)
        self._outline_stale = False  # True: the tree or the sizes changed under the outline
        self.nodes.sigHovered.connect(self._on_hover)
        self.nodes.sigClicked.connect(self._on_click)
        self.vb.sigRangeChangedManually.connect(self._on_manual_range)
        self.vb.sigRangeChanged.connect(self._on_range_changed)
        self.vb.sigResized.connect(self._on_range_changed)
        self.plot.scene().sigMouseClicked.connect(self._on_scene_click)

    # ----------------------------------------------------------------- render
    def show_frame(self, frame: Frame) -> None:
        """Note the frame's snapshot: the tree is rebuilt by `prepare`/`advance` (the window
        paces them) or at once by `flush`."""
        if frame.snapshot is not None:
            self.latest, self.stale = frame.snapshot, True
            self._on_selection()

    def flush(self) -> None:
        """Show the newest snapshot's tree now."""
        if self.stale and self.latest is not None:
            self.stale = False
            self.set_snapshot(self.latest)

    def clear(self) -> None:
        self.latest, self.stale, self._rebuild = None, False, None
        self.snapshot, self.forest, self.flat = None, [], []
        self._xs = self._ys = np.zeros(0)
        self._candidates, self._node_of_block = [], None
        self.nodes.clear()
        self.edges.setData([], [])
        self.outline.clear()
        self._highlighted = np.zeros(0, dtype=np.int64)
        for label in self.labels:
            label.hide()

    def _on_selection(self, *_) -> None:
        self.highlight(self.selection.highlighted(self.latest))

    def set_snapshot(self, snap: Snapshot) -> None:
        """Build the tree of this snapshot and show it, now."""
        self.prepare(snap)
        while self.pending:
            self.advance()

    def prepare(self, snap: Snapshot) -> None:
        """Start rebuilding the tree from this snapshot: run the first of three slices of the
        work now, the others one per advance(). The window runs a slice per frame, so that no
        frame pays for a whole rebuild (a thousand nodes cost a few milliseconds a slice)."""
        self._rebuild = self._rebuild_slices(snap)
        self.advance()

    @property
    def pending(self) -> bool:
        """A rebuild has slices left to run."""
        return self._rebuild is not None

    def advance(self) -> None:
        """Run the next slice of the rebuild, if one is pending; the last one shows the tree."""
        if self._rebuild is not None:
            try:
                next(self._rebuild)
            except StopIteration:
                self._rebuild = None

    def _rebuild_slices(self, snap: Snapshot):
        runs = find_runs(snap)  # numpy over every block
        yield
        forest = make_forest(snap, runs)  # Python per node, and what is drawn from them
        flat = list(walk(forest))
        ref = np.array([min(n.ref_count, 6) for n in flat], dtype=float)
        root = np.array([n.is_root for n in flat], dtype=bool)
        index = {id(n): i for i, n in enumerate(flat)}
        seg = np.array([(index[id(n.parent)], i) for i, n in enumerate(flat) if n.parent],
                       dtype=int).reshape(-1)
        brushes = [self._brushes[n.state] for n in flat]  # the same objects: no new symbols
        candidates = self._label_candidates(flat)
        yield
        self.snapshot, self.forest, self.flat = snap, forest, flat
        xs = self._xs = np.array([n.x for n in flat], dtype=float)
        ys = self._ys = np.array([n.level for n in flat], dtype=float)
        # Zoomed in: 7 to 25 px by ref count. Zoomed out: dots of 3 (cached) to 9 px.
        self._full_size = np.where(root, 9.0, 7.0 + 3.0 * ref)
        self._dot_size = np.where(root, 9.0, 3.0 + ref)
        self._candidates = candidates
        self._node_of_block = None
        self._outline_stale = True
        self.edges.setData(xs[seg] if len(seg) else [], ys[seg] if len(seg) else [])
        self._slot_px = self._slot_pixels()
        self.nodes.setData(x=xs, y=ys, size=self._sizes(self._slot_px), brush=brushes,
                           pen=self._pens[self._slot_px >= 8], data=np.arange(len(flat)))
        if self.auto_fit:
            self.fit()
        self._draw_labels()
        self.highlight(self._highlighted)

    def fit(self) -> None:
        """Show the whole forest (double-click brings this back)."""
        if len(self._xs):
            self.vb.setRange(xRange=(self._xs.min(), self._xs.max()),
                             yRange=(self._ys.min(), self._ys.max()), padding=0.08)

    def _slot_pixels(self) -> float:
        """Screen pixels between two neighbouring leaves (x slots) at the current zoom."""
        (x0, x1), _ = self.vb.viewRange()
        return self.vb.width() / (x1 - x0) if x1 > x0 else 1.0

    def _sizes(self, slot_px: float) -> np.ndarray:
        """Full size where there is room, never smaller than the dot size."""
        return np.maximum(self._dot_size, np.minimum(self._full_size, 0.9 * slot_px))

    def _on_range_changed(self, *_) -> None:
        slot_px = self._slot_pixels()
        if self._slot_px is not None and len(self.flat) and abs(
                slot_px / self._slot_px - 1) > 0.1:
            self._slot_px = slot_px
            self.nodes.setSize(self._sizes(slot_px))
            self.nodes.setPen(self._pens[slot_px >= 8])
            self._outline_stale = True
            self.highlight(self._highlighted)
        self._draw_labels()

    def _label_candidates(self, flat: list[TreeNode]) -> list[tuple[int, str, float]]:
        """(flat index, text, text width in px) of the nodes worth a label, most telling first:
        the longest runs, then the most hits."""
        metrics = QFontMetricsF(self.font())  # the labels' font: the application's
        widths = self._text_px
        out = []
        for i, n in enumerate(flat):
            if len(n.blocks) > 1 or n.hits > 0:
                text = label_text(n)
                if text not in widths:
                    widths[text] = metrics.horizontalAdvance(text) + 2 * LABEL_MARGIN + 2
                out.append((i, text, widths[text]))
        out.sort(key=lambda c: (-len(flat[c[0]].blocks), -flat[c[0]].hits))
        if len(widths) > 10_000:
            widths.clear()
        return out

    def _draw_labels(self) -> None:
        """Label the nodes that matter most where a label fits without covering another; reuse
        the text items: creating them per frame costs more than the tree."""
        (x0, x1), (y0, y1) = self.vb.viewRange()
        width, height = self.vb.width(), self.vb.height()
        wanted = []
        if self._candidates and x1 > x0 and y1 > y0 and width > 0 and height > 0:
            sx, sy = width / (x1 - x0), height / (y1 - y0)
            row_px = QFontMetricsF(self.font()).height() + 2 * LABEL_MARGIN
            gap = (self._sizes(self._slot_px or 1.0) / 2 + 3).tolist()  # px from the centre
            xs, ys = self._xs.tolist(), self._ys.tolist()
            rows: dict[int, list[tuple[float, float]]] = {}
            for i, text, text_px in self._candidates:
                x, y = xs[i], ys[i]
                if not (x0 <= x <= x1 and y0 <= y <= y1):
                    continue
                left = (x - x0) * sx + gap[i]
                right = left + text_px
                row = int((y - y0) * sy // row_px)
                near = itertools.chain(rows.get(row - 1, ()), rows.get(row, ()),
                                       rows.get(row + 1, ()))
                if right > width or any(a < right and left < b for a, b in near):
                    continue
                rows.setdefault(row, []).append((left, right))
                wanted.append((x + gap[i] / sx, y, text))
                if len(wanted) == MAX_LABELS:
                    break
        while len(self.labels) < len(wanted):
            label = pg.TextItem("", color="#333333", anchor=(0, 0.5),
                                fill=pg.mkBrush(255, 255, 255, 190))
            label.textItem.document().setDocumentMargin(LABEL_MARGIN)
            self.plot.addItem(label, ignoreBounds=True)
            self.labels.append(label)
        for label, (x, y, text) in zip(self.labels, wanted, strict=False):
            if label.toPlainText() != text:
                label.setText(text)
            label.setPos(x, y)
            label.show()
        for label in self.labels[len(wanted):]:
            label.hide()

    def highlight(self, blocks) -> None:
        wanted = np.asarray(blocks if blocks is not None else [], dtype=np.int64)
        if not self._outline_stale and np.array_equal(wanted, self._highlighted):
            return  # the same blocks on the same tree: the outline is drawn already
        self._highlighted, self._outline_stale = wanted, False
        picked = np.zeros(0, dtype=np.int64)
        if len(wanted) and self.flat:
            if self._node_of_block is None:
                self._node_of_block = self._block_index()
            inside = wanted[(wanted >= 0) & (wanted < len(self._node_of_block))]
            picked = np.unique(self._node_of_block[inside])
            picked = picked[picked >= 0]
        self.outline.setData(x=self._xs[picked], y=self._ys[picked],
                             size=self._sizes(self._slot_px or 1.0)[picked] + 7)

    def _block_index(self) -> np.ndarray:
        """The flat index of the node holding each block (-1: none; roots hold no block)."""
        index = np.full(self.snapshot.num_blocks if self.snapshot else 0, -1, dtype=np.int64)
        nodes = [(i, n) for i, n in enumerate(self.flat) if not n.is_root]
        if nodes:
            blocks = np.fromiter(itertools.chain.from_iterable(n.blocks for _, n in nodes),
                                 dtype=np.int64)
            index[blocks] = np.repeat([i for i, _ in nodes], [n.count for _, n in nodes])
        return index

    # --------------------------------------------------------------- interact
    def _on_manual_range(self, *_) -> None:
        self.auto_fit = False

    def _on_scene_click(self, event) -> None:
        if event.double():
            self.auto_fit = True
            self.fit()

    def _on_hover(self, item, points, ev) -> None:
        text = ""
        if len(points) and self.snapshot is not None:
            text = node_text(self.flat[points[0].data()], self.snapshot)
            self.info.setText(text)
        self.plot.setToolTip(text)

    def _on_click(self, item, points, ev) -> None:
        if len(points):
            node = self.flat[points[0].data()]
            if not node.is_root:
                self.block_clicked.emit(node.blocks[0])
                self.selection.select_block(node.blocks[0], self.snapshot)
