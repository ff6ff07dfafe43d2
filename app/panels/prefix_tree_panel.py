"""Prefix tree: the real prefix-sharing tree of the pool, coloured by state, sized by ref count.

One ScatterPlotItem for the nodes, one line item for the edges and a bounded number of text
labels, so a thousand nodes stay fast; zoom and pan with the mouse, double-click to fit."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from kvscope.app import palette
from kvscope.app.prefix_tree import TreeNode, build_tree, walk
from kvscope.engine.snapshot import ACTIVE, CACHED, FREE, SHARED, STATE_NAMES, Snapshot

MAX_LABELS = 150
STATE_BRUSH = {FREE: "#bbbbbb", ACTIVE: palette.ACTIVE_COLOR, SHARED: palette.SHARED_COLOR,
               CACHED: palette.CACHED_COLOR, -1: "#444444"}


def node_text(node: TreeNode, snap: Snapshot) -> str:
    if node.is_root:
        return f"root · {sum(1 for _ in walk([node])) - 1} node(s) below"
    first, last = node.blocks[0], node.blocks[-1]
    span = f"block {first}" if node.count == 1 else f"{node.count} blocks {first}…{last}"
    owners = sorted(r for r, t in snap.block_tables.items() if first in t)
    text = f"{span} · {STATE_NAMES[node.state]} · ref {node.ref_count} · hits {node.hits}"
    if owners:
        text += " · owners " + " ".join(f"#{r}" for r in owners)
    return text


class PrefixTreePanel(QWidget):
    block_clicked = Signal(object)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.plot = pg.PlotWidget(background="w")
        self.plot.hideAxis("left")
        self.plot.hideAxis("bottom")
        self.plot.invertY(True)
        self.plot.setMenuEnabled(False)
        self.edges = pg.PlotCurveItem(pen=pg.mkPen("#9a9a9a", width=1), connect="pairs")
        self.nodes = pg.ScatterPlotItem(pxMode=True, hoverable=True)
        self.outline = pg.ScatterPlotItem(pxMode=True, brush=None, symbol="o",
                                          pen=pg.mkPen(palette.SELECTED_OUTLINE, width=2))
        for item in (self.edges, self.nodes, self.outline):
            self.plot.addItem(item)
        self.info = QLabel("The prefix tree of the pool: hover a node for details")
        self.info.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.info.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addWidget(self.plot, 1)
        layout.addWidget(self.info)
        self.labels: list[pg.TextItem] = []
        self._brushes = {state: pg.mkBrush(color) for state, color in STATE_BRUSH.items()}
        self._pen = pg.mkPen("#ffffff")
        self.forest: list[TreeNode] = []
        self.flat: list[TreeNode] = []
        self.snapshot: Snapshot | None = None
        self._shape = None
        self.nodes.sigHovered.connect(self._on_hover)
        self.nodes.sigClicked.connect(self._on_click)

    def set_snapshot(self, snap: Snapshot) -> None:
        self.snapshot = snap
        self.forest = build_tree(snap)
        self.flat = list(walk(self.forest))
        xs = np.array([n.x for n in self.flat], dtype=float)
        ys = np.array([n.level for n in self.flat], dtype=float)
        sizes = [9 if n.is_root else 7 + 3 * min(n.ref_count, 6) for n in self.flat]
        # The same brush and pen objects every frame: the symbol atlas then renders nothing new.
        brushes = [self._brushes[n.state] for n in self.flat]
        self.nodes.setData(x=xs, y=ys, size=sizes, brush=brushes, pen=self._pen,
                           data=list(range(len(self.flat))))
        index = {id(n): i for i, n in enumerate(self.flat)}
        pairs = [(index[id(n.parent)], i) for i, n in enumerate(self.flat) if n.parent]
        seg = np.array(pairs, dtype=int).reshape(-1)
        self.edges.setData(xs[seg] if len(seg) else [], ys[seg] if len(seg) else [])
        self._draw_labels()
        shape = (len(self.flat), float(xs.max()) if len(xs) else 0, float(ys.max()) if len(ys)
                 else 0)
        if shape != self._shape:
            self._shape = shape
            self.plot.autoRange(padding=0.08)

    def _draw_labels(self) -> None:
        """Reuse the text items: creating a hundred of them per frame costs more than the tree."""
        wanted = [n for n in self.flat if n.count > 1 or n.hits > 0][:MAX_LABELS]
        while len(self.labels) < len(wanted):
            label = pg.TextItem("", color="#333333", anchor=(-0.15, 0.5))
            self.plot.addItem(label)
            self.labels.append(label)
        for label, n in zip(self.labels, wanted, strict=False):
            text = (f"×{n.count}" if n.count > 1 else "") + (f" {n.hits} hits" if n.hits else "")
            label.setText(text.strip())
            label.setPos(n.x, n.level)
            label.show()
        for label in self.labels[len(wanted):]:
            label.hide()

    def highlight(self, blocks) -> None:
        wanted = set(np.asarray(blocks if blocks is not None else [], dtype=int).tolist())
        picked = [n for n in self.flat if not n.is_root and wanted.intersection(n.blocks)]
        self.outline.setData(x=[n.x for n in picked], y=[n.level for n in picked],
                             size=[14 + 3 * min(n.ref_count, 6) for n in picked])

    def _on_hover(self, item, points, ev) -> None:
        if len(points) and self.snapshot is not None:
            self.info.setText(node_text(self.flat[points[0].data()], self.snapshot))

    def _on_click(self, item, points, ev) -> None:
        if len(points):
            node = self.flat[points[0].data()]
            if not node.is_root:
                self.block_clicked.emit(node.blocks[0])
