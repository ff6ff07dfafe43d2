"""An experiment's result drawn once for the Experiments panel and the PNG export: each plotted
column against the result's x column (categories such as "fp8" become positions 0, 1, ...;
fractions such as "cached fraction" read in percent)."""

from __future__ import annotations

from pathlib import Path

from kvscope.app import palette
from kvscope.app.plots.axes import percent_axis
from kvscope.app.plots.png import write_plot_png
from kvscope.lab.experiments.result import Result

COLORS = (palette.ACTIVE_COLOR, palette.SHARED_COLOR, palette.DECODE_COLOR, palette.CACHED_COLOR)


def draw_result(item, result: Result) -> None:
    """Draw on a pyqtgraph PlotItem (cleared first)."""
    import pyqtgraph as pg

    item.clear()
    if item.legend is None:
        item.addLegend(offset=(10, 10))
    item.legend.clear()
    item.showGrid(x=True, y=True, alpha=0.3)
    xs = result.column(result.x)
    ticks = None
    if any(isinstance(x, str) for x in xs):
        ticks = [list(enumerate(map(str, xs)))]
        xs = list(range(len(xs)))
    item.getAxis("bottom").setTicks(ticks)
    item.setLabel("bottom", result.x)
    item.setLabel("left", ", ".join(result.ys))
    x_percent = ticks is None and _fraction(result.x)
    y_percent = all(map(_fraction, result.ys))
    percent_axis(item.getAxis("bottom"), x_percent)
    percent_axis(item.getAxis("left"), y_percent)
    if x_percent:
        xs = [100 * float(x) for x in xs]
    for color, name in zip(COLORS, result.ys, strict=False):
        ys = [float(y) * (100 if y_percent else 1) for y in result.column(name)]
        item.plot(xs, ys, pen=pg.mkPen(color, width=2),
                  symbol="o", symbolBrush=color, symbolPen=None, symbolSize=6, name=name)


def _fraction(column: str) -> bool:
    """A column of shares in [0, 1] ("cached fraction"): drawn in percent."""
    return column.endswith("fraction")


def write_result_png(path: Path, result: Result, width: int = 900) -> None:
    write_plot_png(path, lambda item: draw_result(item, result), width)
