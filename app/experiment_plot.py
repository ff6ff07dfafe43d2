"""An experiment's result drawn once for the Experiments panel and the PNG export: each plotted
column against the result's x column (categories such as "fp8" become positions 0, 1, ...)."""

from __future__ import annotations

import os
from pathlib import Path

from kvscope.app import palette
from kvscope.engine.experiments.result import Result

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
    for color, name in zip(COLORS, result.ys, strict=False):
        item.plot(xs, [float(y) for y in result.column(name)], pen=pg.mkPen(color, width=2),
                  symbol="o", symbolBrush=color, symbolPen=None, symbolSize=6, name=name)


def write_result_png(path: Path, result: Result, width: int = 900) -> None:
    if not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    import pyqtgraph as pg
    import pyqtgraph.exporters
    from PySide6.QtWidgets import QApplication

    _app = QApplication.instance() or QApplication([])
    plot = pg.PlotWidget(background="w")
    plot.resize(width, width * 5 // 9)
    draw_result(plot.getPlotItem(), result)
    exporter = pyqtgraph.exporters.ImageExporter(plot.getPlotItem())
    exporter.parameters()["width"] = width
    if not exporter.export(str(path)) and not path.exists():
        raise OSError(f"{path}: could not write the PNG")
