"""Timeline: per-step prefill|decode time (stacked), tokens and batch size, blocks
used/cached/free, and the cumulative token hit rate; x linked, zoom and pan, click selects."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Signal
from PySide6.QtWidgets import QVBoxLayout, QWidget

from kvscope.app import palette
from kvscope.engine.metrics import StepRecord

FIELDS = ("step", "prefill_ms", "decode_ms", "prefill_tokens", "decode_tokens", "batch",
          "active", "cached", "free", "hit_tokens", "query_tokens")


class Timeline(QWidget):
    step_clicked = Signal(int)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.glw = pg.GraphicsLayoutWidget()
        self.glw.setBackground("w")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addWidget(self.glw)
        self.time_plot = self._plot(0, "ms / step", "Forward time per step: prefill (blue) "
                                    "stacked under decode (pink)")
        self.token_plot = self._plot(1, "tokens", "Tokens per step (prefill + decode) and batch "
                                     "size (sequences in the step)")
        self.block_plot = self._plot(2, "blocks", "Blocks active (blue), cached (green) and "
                                     "free (grey) after each step")
        self.hit_plot = self._plot(3, "hit %", "Token hit rate so far: prompt tokens served "
                                   "from the cache / prompt tokens looked up")
        for p in (self.token_plot, self.block_plot, self.hit_plot):
            p.setXLink(self.time_plot)
        self.hit_plot.setYRange(0, 100, padding=0.05)
        self.hit_plot.setLabel("bottom", "step")
        for p in (self.time_plot, self.token_plot, self.block_plot):
            p.hideAxis("bottom")
        fill = lambda c: pg.mkBrush(c)  # noqa: E731
        # Filled lines rather than step curves: pyqtgraph downsamples these when zoomed out.
        self.total_curve = self.time_plot.plot(fillLevel=0, brush=fill(palette.DECODE_COLOR),
                                               pen=pg.mkPen(palette.DECODE_COLOR))
        self.prefill_curve = self.time_plot.plot(fillLevel=0, brush=fill(palette.PREFILL_COLOR),
                                                 pen=pg.mkPen(palette.PREFILL_COLOR))
        self.tokens_curve = self.token_plot.plot(pen=pg.mkPen("#444444"))
        self.batch_curve = self.token_plot.plot(pen=pg.mkPen(palette.SHARED_COLOR))
        self.active_curve = self.block_plot.plot(pen=pg.mkPen(palette.ACTIVE_COLOR, width=2))
        self.cached_curve = self.block_plot.plot(pen=pg.mkPen(palette.CACHED_COLOR, width=2))
        self.free_curve = self.block_plot.plot(pen=pg.mkPen("#999999", width=2))
        self.hit_curve = self.hit_plot.plot(pen=pg.mkPen(palette.CACHED_COLOR, width=2))
        self.cursors = []
        for p in (self.time_plot, self.token_plot, self.block_plot, self.hit_plot):
            line = pg.InfiniteLine(angle=90, movable=False, pen=pg.mkPen("#000000", width=1))
            line.hide()
            p.addItem(line)
            self.cursors.append(line)
            p.scene().sigMouseClicked.connect(self._on_click)
        self.data = {f: np.zeros(0) for f in FIELDS}
        self._hit = self._query = 0

    def _plot(self, row: int, label: str, tip: str) -> pg.PlotItem:
        p = self.glw.addPlot(row=row, col=0)
        p.setLabel("left", label)
        p.getAxis("left").setWidth(56)
        p.setToolTip(tip)
        p.showGrid(x=False, y=True, alpha=0.2)  # vertical grid lines cost more than they help
        p.setMenuEnabled(False)
        p.setMouseEnabled(x=True, y=False)
        p.setDownsampling(auto=True, mode="peak")  # 10,000 steps draw as a few hundred
        p.setClipToView(True)
        return p

    def clear(self) -> None:
        self.data = {f: np.zeros(0) for f in FIELDS}
        self._hit = self._query = 0
        self._redraw()

    def add_records(self, records: list[StepRecord]) -> None:
        if not records:
            return
        cols = {
            "step": [r.step for r in records],
            "prefill_ms": [r.prefill_s * 1e3 for r in records],
            "decode_ms": [r.decode_s * 1e3 for r in records],
            "prefill_tokens": [r.prefill_tokens for r in records],
            "decode_tokens": [r.decode_tokens for r in records],
            "batch": [r.batch_size for r in records],
            "active": [r.num_active_blocks for r in records],
            "cached": [r.num_cached_blocks for r in records],
            "free": [r.num_free_blocks for r in records],
            "hit_tokens": np.cumsum([r.hit_tokens for r in records]) + self._hit,
            "query_tokens": np.cumsum([r.query_tokens for r in records]) + self._query,
        }
        self._hit, self._query = int(cols["hit_tokens"][-1]), int(cols["query_tokens"][-1])
        for f in FIELDS:
            self.data[f] = np.concatenate([self.data[f], np.asarray(cols[f], dtype=np.float64)])
        self._redraw()

    def _redraw(self) -> None:
        d = self.data
        x = d["step"]
        if len(x) == 0:
            for c in (self.total_curve, self.prefill_curve, self.tokens_curve, self.batch_curve,
                      self.active_curve, self.cached_curve, self.free_curve, self.hit_curve):
                c.setData([], [])
            return
        self.total_curve.setData(x, d["prefill_ms"] + d["decode_ms"])
        self.prefill_curve.setData(x, d["prefill_ms"])
        self.tokens_curve.setData(x, d["prefill_tokens"] + d["decode_tokens"])
        self.batch_curve.setData(x, d["batch"])
        self.active_curve.setData(x, d["active"])
        self.cached_curve.setData(x, d["cached"])
        self.free_curve.setData(x, d["free"])
        q = d["query_tokens"]
        self.hit_curve.setData(x, np.divide(100 * d["hit_tokens"], q, out=np.zeros_like(q),
                                            where=q > 0))

    def set_cursor(self, step: int | None) -> None:
        for line in self.cursors:
            line.setVisible(step is not None)
            if step is not None:
                line.setValue(step)

    def _on_click(self, event) -> None:
        for p in (self.time_plot, self.token_plot, self.block_plot, self.hit_plot):
            if p.sceneBoundingRect().contains(event.scenePos()):
                x = p.vb.mapSceneToView(event.scenePos()).x()
                if len(self.data["step"]):
                    i = int(np.clip(np.searchsorted(self.data["step"], x), 0,
                                    len(self.data["step"]) - 1))
                    self.step_clicked.emit(int(self.data["step"][i]))
                return
