"""Light grid lines for a pyqtgraph plot, at its axes' major ticks.

pyqtgraph's own grid (PlotItem.showGrid) costs more to paint than the curves in front of it
(several milliseconds a plot on a 2-core machine); one line item per plot is nearly free."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg

GRID_COLOR = "#e6e6e6"


class Grid:
    """Vertical lines at the bottom axis' ticks (x) and horizontal ones at the left axis' (y),
    or at fixed values; redrawn with the view, the ticks recomputed only when they can move."""

    def __init__(self, plot: pg.PlotItem, x: bool = False, y: bool = True,
                 y_ticks: tuple[float, ...] | None = None):
        self.plot, self.x, self.y, self.y_ticks = plot, x, y, y_ticks
        self.item = pg.PlotCurveItem(pen=pg.mkPen(GRID_COLOR), connect="pairs", antialias=False)
        self.item.setZValue(-10)
        plot.vb.addItem(self.item, ignoreBounds=True)  # the view box's, not a data item
        self._key = None
        self._xs = self._ys = np.zeros(0)
        plot.vb.sigRangeChanged.connect(self.draw)
        plot.vb.sigResized.connect(self.draw)

    def _ticks(self, axis: str, lo: float, hi: float, pixels: float, fixed) -> np.ndarray:
        if fixed is None:
            levels = self.plot.getAxis(axis).tickValues(lo, hi, max(1.0, pixels))
            fixed = levels[0][1] if levels else []
        return np.array([v for v in fixed if lo <= v <= hi], dtype=float)

    def draw(self, *_) -> None:
        vb = self.plot.vb
        (x0, x1), (y0, y1) = vb.viewRange()
        # The ticks move only with their own axis' range (the timeline's x changes every step).
        key = ((x0, x1, vb.width()) if self.x else None, (y0, y1, vb.height()) if self.y else None)
        if key != self._key:
            self._key = key
            if self.x:
                self._xs = self._ticks("bottom", x0, x1, vb.width(), None)
            if self.y:
                self._ys = self._ticks("left", y0, y1, vb.height(), self.y_ticks)
        xs, ys = self._xs, self._ys
        self.item.setData(np.concatenate([np.tile([x0, x1], len(ys)), np.repeat(xs, 2)]),
                          np.concatenate([np.repeat(ys, 2), np.tile([y0, y1], len(xs))]))
