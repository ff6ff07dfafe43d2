"""A pyqtgraph plot written to a PNG file, with or without a display (offscreen Qt then)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def write_plot_png(path: Path, draw: Callable, width: int = 900) -> None:
    """draw(plot_item) fills a fresh white plot of `width` x 5/9 `width` pixels."""
    if not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    import pyqtgraph as pg
    import pyqtgraph.exporters
    from PySide6.QtWidgets import QApplication

    _app = QApplication.instance() or QApplication([])
    plot = pg.PlotWidget(background="w")
    plot.resize(width, width * 5 // 9)
    draw(plot.getPlotItem())
    exporter = pyqtgraph.exporters.ImageExporter(plot.getPlotItem())
    exporter.parameters()["width"] = width
    if not exporter.export(str(path)) and not path.exists():
        raise OSError(f"{path}: could not write the PNG")
