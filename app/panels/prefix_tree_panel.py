"""Prefix tree: the real prefix-sharing tree of the pool, coloured by state, sized by ref count.

One ScatterPlotItem for the nodes, one line item for the edges and a few text labels placed
where they do not overlap, so a thousand nodes stay fast and readable: zoomed out, nodes shrink
to dots (cached smallest, shared biggest) and only the longest runs are labelled; zoom with the
wheel and pan to read the rest; double-click fits the tree again. Each root is labelled with its
identity (model and cache salt), and no label leaves the view."""

from __future__ import annotations

import bisect
import itertools

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QFontMetricsF, QTextDocument
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from kvscope.app import palette
from kvscope.app.frames import Frame
from kvscope.app.prefix_tree import TreeNode, find_runs, make_forest, walk
from kvscope.app.selection import Selection
from kvscope.app.tree_identities import Identities
from kvscope.engine.snapshot import ACTIVE, CACHED, FREE, SHARED, STATE_NAMES, Snapshot

MAX_LABELS = 40
LABEL_MARGIN = 1  # px around a label's text
STATE_BRUSH = {FREE: "#bbbbbb", ACTIVE: palette.ACTIVE_COLOR, SHARED: palette.SHARED_COLOR,
               CACHED: palette.CACHED_COLOR, -1: "#444444"}


def _requests(n: int) -> str:
    return f"{n} request{'s' if n != 1 else ''}"


def node_text(node: TreeNode, snap: Snapshot, identities: Identities | None = None) -> str:
    if node.is_root:
        return (identities or Identities()).words(node)
    first, last = node.blocks[0], node.blocks[-1]
    span = f"block {first}" if node.count == 1 else f"{node.count} blocks {first}…{last}"
    owners = sorted(r for r, t in snap.block_tables.items() if first in t)
    text = (f"{span} · {STATE_NAMES[node.state]} · ref {node.ref_count} · hit by "
            f"{_requests(node.hits)}")
    if owners:
        text += " · owners " + " ".join(f"#{r}" for r in owners)
    return text


def label_texts(node: TreeNode) -> list[str]:
    """A node's label, longest first (empty: no label): the run's length and the requests that
    hit it, then fewer words where the long one does not fit."""
    count = f"×{node.count}" if node.count > 1 else ""
    if not node.hits:
        return [count] if count else []
    hit = f"hit by {_requests(node.hits)}"
    if count:
        return [f"{count} · {hit}", count]
    return [hit, f"hit by {node.hits}"]


def _covers(dots: tuple[list[float], float] | None, left: float, right: float) -> bool:
    """Whether a node of this row (sorted centres, radius) reaches into [left, right]."""
    if dots is None:
        return False
    centres, radius = dots
    i = bisect.bisect_left(centres, left - radius)
    return i < len(centres) and centres[i] < right + radius


def _free(left: float, right: float, room: tuple[float, float],
          labels: list[tuple[float, float]], dots: list) -> bool:
    """Whether a label over [left, right] (px) stays in its room and covers no label placed
    already and no node of the given rows."""
    if left < room[0] or right > room[1]:
        return False
    for a, b in labels:
        if a < right and left < b:
            return False
    return not any(_covers(d, left, right) for d in dots)


def label_text(node: TreeNode) -> str:
    texts = label_texts(node)
    return texts[0] if texts else ""


HINT = ("The prefix tree of the pool: hover a node for details; wheel to zoom, drag to pan, "
        "double-click to fit")
FIT_PADDING = 0.08  # of the forest's extent, on each side, when fitted


def _padded(lo: float, hi: float, pad: float) -> tuple[float, float]:
    span = (hi - lo) or 1.0  # one node, or one row: a unit around it
    return lo - pad * span, hi + pad * span


class PrefixTreePanel(QWidget):
    block_clicked = Signal(object)

    def __init__(self, selection: Selection | None = None, parent=None):
        super().__init__(parent)
        self.selection = selection or Selection()
        self.selection.request_changed.connect(self._on_selection)
        self.selection.blocks_changed.connect(self._on_selection)
        self.identities = Identities()  # what each root stands for, learnt from the frames
        self.latest: Snapshot | None = None  # the newest snapshot shown (the tree may lag it)
        self.stale = False  # a snapshot came since the last rebuild began
        self.plot = pg.PlotWidget(background="w", enableMenu=False)
        self.plot.hideAxis("left")
        self.plot.hideAxis("bottom")
        self.plot.invertY(True)
        self.vb = self.plot.plotItem.vb
        self.edges = pg.PlotCurveItem(pen=pg.mkPen("#9a9a9a", width=1), connect="pairs")
        self.nodes = pg.ScatterPlotItem(pxMode=True, hoverable=True, tip=None)  # ours, in words
        self.outline = pg.ScatterPlotItem(pxMode=True, brush=None, symbol="o",
                                          pen=pg.mkPen(palette.SELECTED_OUTLINE, width=2))
        self.plot.addItem(self.edges)
        self.plot.addItem(self.nodes)
        self.plot.addItem(self.outline, ignoreBounds=True)
        self.info = QLabel(HINT)
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
        self._candidates: list[tuple[int, list[str], list[float]]] = []  # for labels
        self._texts: dict[tuple[int, int], tuple[list[str], list[float]]] = {}
        self._row_px = 0.0  # a label's height, measured with its width's slack by _measure
        self._metrics: QFontMetricsF | None = None
        self._slack = 0.0  # px a label's item adds to its text's advance
        self._roots: list[int] = []  # flat indices of the roots
        self._rebuild = None  # the slices of a rebuild still to run (a generator)
        self._highlighted = np.zeros(0, dtype=np.int64)
        self._outline_stale = False  # True: the tree or the sizes changed under the outline
        # the node the caption describes: ("block", its first block) or ("root", its key)
        self._hovered: tuple[str, int] | None = None
        self.nodes.sigHovered.connect(self._on_hover)
        self.nodes.sigClicked.connect(self._on_click)
        self.vb.sigRangeChangedManually.connect(self._on_manual_range)
        self.vb.sigRangeChanged.connect(self._on_range_changed)
        self.vb.sigResized.connect(self._on_range_changed)
        self.plot.scene().sigMouseClicked.connect(self._on_scene_click)

    # ----------------------------------------------------------------- render
    def show_frame(self, frame: Frame) -> None:
        """Note the frame's snapshot: the tree is rebuilt by `start_rebuild`/`advance` (the
        window paces them) or at once by `flush`."""
        self.identities.learn(frame)
        if frame.snapshot is not None:
            self.latest, self.stale = frame.snapshot, True
            self._on_selection()

    def set_identity(self, model: str, digests: bool = False) -> None:
        """The model the roots' chains come from, and whether the frames' salts are digests
        (a replay); forgets the identities learnt from the source shown before."""
        self.identities.reset(model, digests)

    def flush(self) -> None:
        """Show the newest snapshot's tree now."""
        if self.start_rebuild():
            while self.pending:
                self.advance()

    def start_rebuild(self) -> bool:
        """Start rebuilding the tree of the newest snapshot shown, if one came since the last
        rebuild began (True: started; `advance` runs its other slices)."""
        if not self.stale or self.latest is None:
            return False
        self.prepare(self.latest)
        self.stale = False
        return True

    def clear(self) -> None:
        self.latest, self.stale, self._rebuild = None, False, None
        self.identities.reset(self.identities.model, self.identities.digests)
        self.snapshot, self.forest, self.flat = None, [], []
        self._xs = self._ys = np.zeros(0)
        self._candidates, self._node_of_block, self._roots = [], None, []
        self.nodes.clear()
        self.edges.setData([], [])
        self.outline.clear()
        self._highlighted = np.zeros(0, dtype=np.int64)
        for label in self.labels:
            label.hide()
        self._hovered = None
        self._describe_hovered()

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
        self._roots = [i for i, n in enumerate(flat) if n.is_root]
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
        self._describe_hovered()  # the node hovered last, as this snapshot has it

    def fit(self) -> None:
        """Show the whole forest (double-click brings this back), with room above the top row
        and below the bottom one for half a label: in a short dock 8 % of the range is fewer
        pixels than that, and the root's label (its identity) would not be drawn."""
        if not len(self._xs):
            return
        margin = self._label_px() / 2 + 2
        height = self.vb.height()
        pad = FIT_PADDING
        if height > 4 * margin:
            pad = max(pad, margin / (height - 2 * margin))
        self.vb.setRange(xRange=_padded(self._xs.min(), self._xs.max(), FIT_PADDING),
                         yRange=_padded(self._ys.min(), self._ys.max(), pad), padding=0)

    def _label_px(self) -> float:
        """A label's height in px."""
        return self._row_px or QFontMetricsF(self.font()).height() + 2 * LABEL_MARGIN

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

    def _measure(self, text: str) -> float:
        """A label's width in px, as its text item draws it (the document's margins and a
        pixel of slack around the text's advance; a text document per label costs 20x more)."""
        if not self._row_px:
            doc = QTextDocument()
            doc.setDefaultFont(self.font())  # the labels' font: the application's
            doc.setDocumentMargin(LABEL_MARGIN)
            doc.setPlainText("×9")
            self._row_px = doc.size().height()
            self._metrics = QFontMetricsF(self.font())
            self._slack = doc.size().width() - self._metrics.horizontalAdvance("×9") + 1
        return self._metrics.horizontalAdvance(text) + self._slack

    def _label_candidates(self, flat: list[TreeNode]) -> list[tuple[int, list[str], list[float]]]:
        """(flat index, texts longest first, their widths in px) of the nodes worth a label,
        most telling first: the roots (their identity), the longest runs, then the most hits."""
        made = self._texts  # (blocks, hits) -> (texts, widths): most nodes share one
        out, order = [], []
        for i, n in enumerate(flat):
            if n.is_root:
                texts = self.identities.labels(n)
                label = (texts, [self._measure(t) for t in texts])
                rank = (0, 0, 0)
            elif n.count > 1 or n.hits:
                key = (n.count, n.hits)
                label = made.get(key)
                if label is None:
                    texts = label_texts(n)
                    label = made[key] = (texts, [self._measure(t) for t in texts])
                rank = (1, -n.count, -n.hits)
            else:
                continue
            out.append((i, *label))
            order.append(rank)
        out = [c for _, c in sorted(zip(order, out, strict=True), key=lambda p: p[0])]
        if len(made) > 10_000:
            made.clear()
        return out

    def _draw_labels(self) -> None:
        """Label the nodes that matter most where a label fits inside the view without covering
        another: right of its node, else left of it, else in fewer words; reuse the text items:
        creating them per frame costs more than the tree."""
        (x0, x1), (y0, y1) = self.vb.viewRange()
        width, height = self.vb.width(), self.vb.height()
        wanted = []
        if self._candidates and x1 > x0 and y1 > y0 and width > 0 and height > 0:
            sx, sy = width / (x1 - x0), height / (y1 - y0)
            row_px = self._label_px()
            gap = (self._sizes(self._slot_px or 1.0) / 2 + 3).tolist()  # px from the centre
            xs, ys = self._xs.tolist(), self._ys.tolist()
            rows: dict[int, list[tuple[float, float]]] = {}
            dots = self._dots_by_row(x0, y0, sx, sy, row_px)
            bounds = self._root_bounds(x0, sx, width)
            for i, texts, text_pxs in self._candidates:
                x, y = xs[i], ys[i]
                if not (x0 <= x <= x1 and y0 <= y <= y1):
                    continue
                cx, cy = (x - x0) * sx, (y - y0) * sy
                if cy - row_px / 2 < 0 or cy + row_px / 2 > height:
                    continue  # it would be cut at the top or the bottom
                row = int(cy // row_px)
                near = list(itertools.chain(rows.get(row - 1, ()), rows.get(row, ()),
                                            rows.get(row + 1, ())))
                room = bounds.get(i, (0.0, width))
                row_dots = [dots.get(r) for r in (row - 1, row, row + 1)]
                short = text_pxs[-1]
                if not (_free(cx + gap[i], cx + gap[i] + short, room, near, ())
                        or _free(cx - gap[i] - short, cx - gap[i], room, near, ())):
                    continue  # no room even for the fewest words (most nodes of a big tree)
                # Clear of every node if it can be; else the fewest words over small dots.
                tries = [(t, px, False) for t, px in zip(texts, text_pxs, strict=True)]
                for text, text_px, over_nodes in tries + [(texts[-1], short, True)]:
                    spot = next((left for left in (cx + gap[i], cx - gap[i] - text_px)
                                 if _free(left, left + text_px, room, near,
                                          [] if over_nodes else row_dots)), None)
                    if spot is not None:
                        rows.setdefault(row, []).append((spot, spot + text_px))
                        wanted.append((x0 + spot / sx, y, text))
                        break
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

    def _root_bounds(self, x0: float, sx: float, width: float) -> dict[int, tuple[float, float]]:
        """Per root (flat index), the span (px) its label may take: up to halfway to the
        roots beside it, so that every root of a row gets a label, in fewer words if need be."""
        at = {i: (self._xs[i] - x0) * sx for i in self._roots}
        order = sorted(at, key=at.get)
        cuts = ([0.0] + [(at[a] + at[b]) / 2 for a, b in itertools.pairwise(order)] + [width])
        return {i: (max(0.0, cuts[k]), min(width, cuts[k + 1])) for k, i in enumerate(order)}

    def _dots_by_row(self, x0, y0, sx, sy, row_px) -> dict[int, tuple[list[float], float]]:
        """Per label row, the sorted x (px) of the nodes drawn in it and their largest radius:
        a label never covers a node."""
        if not len(self._xs):
            return {}
        px = (self._xs - x0) * sx
        row = ((self._ys - y0) * sy // row_px).astype(np.int64)
        radius = self._sizes(self._slot_px or 1.0) / 2 + 1
        order = np.lexsort((px, row))
        rows, starts = np.unique(row[order], return_index=True)
        bounds = np.append(starts, len(order)).tolist()
        px, radius = px[order].tolist(), radius[order]
        return {r: (px[a:b], float(radius[a:b].max()))
                for r, a, b in zip(rows.tolist(), bounds[:-1], bounds[1:], strict=True)}

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
            node = self.flat[points[0].data()]
            self._hovered = ("root", node.key) if node.is_root else ("block", node.blocks[0])
            text = self._describe_hovered()
        self.plot.setToolTip(text)

    def _describe_hovered(self) -> str:
        """The caption: the node hovered last as the tree shown has it (rebuilt for a new step
        or source: said anew, or the hint where the node is gone)."""
        node = None
        if self._hovered is not None and self.flat:
            kind, value = self._hovered
            if kind == "root":
                node = next((self.flat[i] for i in self._roots if self.flat[i].key == value),
                            None)
            else:
                if self._node_of_block is None:
                    self._node_of_block = self._block_index()
                if value < len(self._node_of_block) and self._node_of_block[value] >= 0:
                    node = self.flat[self._node_of_block[value]]
        text = HINT if node is None else node_text(node, self.snapshot, self.identities)
        if node is None:
            self._hovered = None
        if text != self.info.text():
            self.info.setText(text)
        return "" if node is None else text

    def _on_click(self, item, points, ev) -> None:
        if len(points):
            node = self.flat[points[0].data()]
            if not node.is_root:
                self.block_clicked.emit(node.blocks[0])
                self.selection.select_block(node.blocks[0], self.snapshot)
