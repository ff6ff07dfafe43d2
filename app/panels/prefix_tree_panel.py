"""Prefix tree: the real prefix-sharing tree of the pool, coloured by state, sized by ref count.

One ScatterPlotItem for the nodes, one line item for the edges and a few text labels placed
where they do not overlap, so a thousand nodes stay fast and readable: zoomed out, nodes shrink
to dots (cached smallest, shared biggest) and only the longest runs are labelled; zoom with the
wheel and pan to read the rest; double-click fits the tree again. Each root is labelled with its
identity (model and cache salt), and no label leaves the view."""

from __future__ import annotations

import itertools

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from kvscope.app import palette
from kvscope.app.frames import Frame
from kvscope.app.panels.tree_labels import TreeLabels, requests_word
from kvscope.app.prefix_tree import TreeNode, find_runs, group_tables, make_forest, walk
from kvscope.app.selection import Selection
from kvscope.app.tree_identities import Identities
from kvscope.engine.kv_groups import KVGroup
from kvscope.engine.snapshot import ACTIVE, CACHED, FREE, SHARED, STATE_NAMES, Snapshot

STATE_BRUSH = {FREE: "#bbbbbb", ACTIVE: palette.ACTIVE_COLOR, SHARED: palette.SHARED_COLOR,
               CACHED: palette.CACHED_COLOR, -1: "#444444"}


def node_text(node: TreeNode, snap: Snapshot, identities: Identities | None = None,
              group: int = 0) -> str:
    """A node in words (`group`: the KV-cache group whose tree holds it)."""
    if node.is_root:
        return (identities or Identities()).words(node)
    first, last = node.blocks[0], node.blocks[-1]
    span = f"block {first}" if node.count == 1 else f"{node.count} blocks {first}…{last}"
    owners = sorted(r for r, t in group_tables(snap, group).items() if first in t)
    text = (f"{span} · {STATE_NAMES[node.state]} · ref {node.ref_count} · hit by "
            f"{requests_word(node.hits)}")
    if owners:
        text += " · owners " + " ".join(f"#{r}" for r in owners)
    return text


def group_layers(g: KVGroup) -> str:
    """A group's layers in words (its entry's tooltip in the selector)."""
    n = len(g.layers)
    return (f"{g.name}: layer{'s' if n != 1 else ''} {', '.join(map(str, g.layers))}" if n
            else f"{g.name}: every layer")


GROUP_TIP = ("The KV-cache group whose prefix tree is shown: each group has its own block tables "
             "and hashes. A sliding-window group's tree shows the blocks still cached or held; "
             "the heads of its chains, released out of the window, go as they are evicted")
HINT = ("The prefix tree of the pool: hover a node for details; wheel to zoom, drag to pan, "
        "double-click to fit")
FIT_PADDING = 0.08  # of the forest's extent, on each side, when fitted


def _padded(lo: float, hi: float, pad: float) -> tuple[float, float]:
    span = (hi - lo) or 1.0  # one node, or one row: a unit around it
    return lo - pad * span, hi + pad * span


class PrefixTreePanel(TreeLabels, QWidget):
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
        self.group = 0  # the KV-cache group whose tree is shown
        self.group_box = QComboBox()
        self.group_box.setToolTip(GROUP_TIP)
        self.group_box.setSizeAdjustPolicy(QComboBox.AdjustToContents)
        self.group_box.currentIndexChanged.connect(self.show_group)
        self.group_row = QWidget()  # shown only for a model with several groups
        row = QHBoxLayout(self.group_row)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(QLabel("KV group"))
        row.addWidget(self.group_box)
        row.addStretch(1)
        self.group_row.hide()
        self._groups: tuple[KVGroup, ...] = ()  # what the selector lists
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addWidget(self.group_row)
        layout.addWidget(self.plot, 1)
        layout.addWidget(self.info)
        self._init_labels()
        self._brushes = {state: pg.mkBrush(color) for state, color in STATE_BRUSH.items()}
        self._pens = {True: pg.mkPen("#ffffff"), False: pg.mkPen(None)}
        self.forest: list[TreeNode] = []
        self.flat: list[TreeNode] = []
        self.snapshot: Snapshot | None = None
        self._tree_group = 0  # the group of the tree shown (self.group may be newer)
        self.auto_fit = True  # until the user zooms or pans
        self._xs = self._ys = self._full_size = self._dot_size = np.zeros(0)
        self._slot_px: float | None = None  # pixels per leaf slot the sizes were made for
        self._node_of_block: np.ndarray | None = None  # built on the first highlight
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
            self._list_groups(frame.snapshot.groups)
            self._on_selection()

    def _list_groups(self, groups: tuple[KVGroup, ...]) -> None:
        """The selector lists the snapshot's groups (hidden with one); a new list starts at
        group 0 (full attention, where the model has it)."""
        if groups == self._groups:
            return
        self._groups = groups
        self.group_box.blockSignals(True)
        self.group_box.clear()
        for i, g in enumerate(groups):
            self.group_box.addItem(g.name)
            self.group_box.setItemData(i, group_layers(g), Qt.ToolTipRole)
        self.group_box.blockSignals(False)
        self.group_row.setVisible(len(groups) > 1)
        self.group = 0
        self.group_box.setCurrentIndex(0)

    def show_group(self, group: int) -> None:
        """Show the tree of this KV-cache group (now: the user picked it), fitted."""
        if group < 0 or group == self.group:
            return
        self.group = group
        self.group_box.setCurrentIndex(group)
        self._hovered = None
        self.auto_fit, self.stale = True, self.latest is not None
        self.flush()
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
        self.highlight(self.selection.highlighted(self.latest))  # (the shown group's nodes)

    def set_snapshot(self, snap: Snapshot) -> None:
        """Build the tree of this snapshot and show it, now."""
        self.prepare(snap)
        while self.pending:
            self.advance()

    def prepare(self, snap: Snapshot) -> None:
        """Start rebuilding the tree from this snapshot: run the first of three slices of the
        work now, the others one per advance(). The window runs a slice per frame, so that no
        frame pays for a whole rebuild (a thousand nodes cost a few milliseconds a slice)."""
        self._rebuild = self._rebuild_slices(snap, min(self.group, len(snap.groups) - 1))
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

    def _rebuild_slices(self, snap: Snapshot, group: int):
        runs = find_runs(snap, group=group)  # numpy over every block
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
        self.snapshot, self.forest, self.flat, self._tree_group = snap, forest, flat, group
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
        text = HINT if node is None else node_text(node, self.snapshot, self.identities,
                                                   self._tree_group)
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
