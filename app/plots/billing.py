"""Cost against TTL (lab.billing.cost_curve), drawn once for the Lab panel and the PNG export:
the trace's cost with prompt caching at each TTL (log axis, 1 min to 2 h), the cost without
caching as a dashed line."""

from __future__ import annotations

import math
from pathlib import Path

from kvscope.app import palette
from kvscope.app.plots.axes import percent_axis
from kvscope.app.plots.png import write_plot_png


def draw_cost_curve(item, points: list[tuple[float, float]], without: float) -> None:
    import pyqtgraph as pg

    item.clear()
    if item.legend is None:
        item.addLegend(offset=(10, 10))
    item.setLogMode(x=True, y=False)
    item.setLabel("bottom", "TTL (expiry after the last use)")
    item.setLabel("left", "cost of the trace ($)")
    percent_axis(item.getAxis("left"), False)
    item.showGrid(x=True, y=True, alpha=0.3)
    xs, ys = zip(*points, strict=True)
    item.getAxis("bottom").setTicks([[(math.log10(t), duration(t)) for t in xs], []])
    item.plot(xs, ys, pen=pg.mkPen(palette.ACTIVE_COLOR, width=2), symbol="o",
              symbolBrush=palette.ACTIVE_COLOR, symbolPen=None, name="with prompt caching")
    item.plot([xs[0], xs[-1]], [without, without], name="without caching",
              pen=pg.mkPen(palette.EVICTED_COLOR, width=2, style=pg.QtCore.Qt.PenStyle.DashLine))


def duration(seconds: float) -> str:
    """60 -> "1 min", 7200 -> "2 h", 45 -> "45 s"."""
    for unit, size in (("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size:g} {unit}"
    return f"{seconds:g} s"


def write_cost_png(path: Path, points: list[tuple[float, float]], without: float,
                   width: int = 900) -> None:
    write_plot_png(path, lambda item: draw_cost_curve(item, points, without), width)
