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
GRID_COLOR = "#e6e6e6"
# Auto-downsampling keeps the min and max of each bucket ("peak"): one bucket per pixel draws
# the same envelope as every sample, at a fraction of the cost (pyqtgraph's default is 5).
SAMPLES_PER_PIXEL = 1.0


def _draw_grid(p: pg.PlotItem, grid: pg.PlotCurveItem, ticks=None) -> None:
    """Horizontal lines across the view at the left axis' major ticks (or at fixed ticks)."""
    (x0, x1), (y0, y1) = p.vb.viewRange()
    if ticks is None:
        axis = p.getAxis("left")
        levels = axis.tickValues(y0, y1, max(1.0, axis.height()))
        ticks = levels[0][1] if levels else []
    ys = np.array([v for v in ticks if y0 <= v <= y1])
    grid.setData(np.tile([x0, x1], len(ys)), np.repeat(ys, 2))


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
                                   "from the cache / prompt tokens looked up", ticks=(0, 50, 100))
        for p in (self.token_plot, self.block_plot, self.hit_plot):
            p.setXLink(self.time_plot)
        self.hit_plot.setYRange(0, 100, padding=0.05)
        self.hit_plot.setLabel("bottom", "step")
        for p in (self.time_plot, self.token_plot, self.block_plot):
            p.hideAxis("bottom")
        # Filled lines rather than step curves: pyqtgraph downsamples these when zoomed out.
        # Width-1 cosmetic pens: wide lines cost several times more to rasterise.
        self.total_curve = self._curve(self.time_plot, palette.DECODE_COLOR, fill=True)
        self.prefill_curve = self._curve(self.time_plot, palette.PREFILL_COLOR, fill=True)
        self.tokens_curve = self._curve(self.token_plot, "#444444")
        self.batch_curve = self._curve(self.token_plot, palette.SHARED_COLOR)
        self.active_curve = self._curve(self.block_plot, palette.ACTIVE_COLOR)
        self.cached_curve = self._curve(self.block_plot, palette.CACHED_COLOR)
        self.free_curve = self._curve(self.block_plot, "#999999")
        self.hit_curve = self._curve(self.hit_plot, palette.CACHED_COLOR)
        self.cursors = []
        for p in (self.time_plot, self.token_plot, self.block_plot, self.hit_plot):
            line = pg.InfiniteLine(angle=90, movable=False, pen=pg.mkPen("#000000", width=1))
            line.hide()
            p.addItem(line)
            self.cursors.append(line)
            p.scene().sigMouseClicked.connect(self._on_click)
        self.data = {f: np.zeros(0) for f in FIELDS}
        self._hit = self._query = 0

    def _plot(self, row: int, label: str, tip: str, ticks=None) -> pg.PlotItem:
        p = self.glw.addPlot(row=row, col=0)
        p.setLabel("left", label)
        if ticks is not None:  # a short plot: a few round ticks rather than a crowded axis
            p.getAxis("left").setTicks([[(v, str(v)) for v in ticks]])
        p.getAxis("left").setWidth(56)
        p.setToolTip(tip)
        # pyqtgraph's own grid (showGrid) costs more to paint than all the curves together:
        # one light line item per plot at the axis' major ticks instead.
        grid = pg.PlotCurveItem(pen=pg.mkPen(GRID_COLOR), connect="pairs", antialias=False)
        grid.setZValue(-10)
        p.vb.addItem(grid, ignoreBounds=True)  # the view box's, not a data item of the plot
        p.vb.sigRangeChanged.connect(lambda *_: _draw_grid(p, grid, ticks))
        p.setMenuEnabled(False)
        p.setMouseEnabled(x=True, y=False)
        p.setDownsampling(auto=True, mode="peak")  # 10,000 steps: the min and max per pixel
        p.setClipToView(True)
        return p

    @staticmethod
    def _curve(plot: pg.PlotItem, color: str, fill: bool = False) -> pg.PlotDataItem:
        return plot.plot(pen=pg.mkPen(color), fillLevel=0 if fill else None,
                         brush=pg.mkBrush(color) if fill else None,
                         autoDownsampleFactor=SAMPLES_PER_PIXEL)

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
