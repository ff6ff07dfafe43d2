"""Device: GPU memory used/total and utilisation over time (NVML), or, without an NVIDIA GPU,
kvscope's resident memory (the window's process and its engine process) and the
system's memory (psutil). Sampled by a QTimer at 2 Hz;
the last ten minutes are kept."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from kvscope.app import palette
from kvscope.app.panels import FrameIndependent
from kvscope.app.panels.plot_grid import Grid
from kvscope.app.workers.device_monitor import DeviceMonitor, DeviceSample, History

GIB = 2**30
GPU_COLORS = (palette.ACTIVE_COLOR, palette.SHARED_COLOR, palette.CACHED_COLOR,
              palette.DECODE_COLOR, palette.PREFILL_COLOR, palette.EVICTED_COLOR)
TIP_RSS = ("kvscope RSS: bytes of the window's process and its engine process resident in host "
           "RAM, from psutil memory_info().rss.")
TIP_SYSTEM = ("System memory used = total − available (psutil virtual_memory): RAM that cannot "
              "be handed to a new program without swapping.")
TIP_GPU_MEM = ("GPU memory used: bytes allocated on the device by all processes, of the total "
               "(NVML nvmlDeviceGetMemoryInfo). 'kvscope' is what its engine process holds "
               "(weights, KV pool, PyTorch's cache).")
TIP_GPU_UTIL = ("GPU utilisation: percent of the last sample period (1/6 s to 1 s, set by the "
                "driver) in which at least one kernel was running (NVML "
                "nvmlDeviceGetUtilizationRates.gpu). 100% does not mean every SM was busy.")


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


class DevicePanel(QWidget, FrameIndependent):
    def __init__(self, monitor: DeviceMonitor | None = None, interval_ms: int = 500,
                 history_s: float = 600.0, autostart: bool = True, parent=None):
        super().__init__(parent)
        self.monitor = monitor or DeviceMonitor()
        self.history = History(history_s, interval_ms / 1000)
        self.gpu_mode = self.monitor.has_gpu  # fixed at construction: which plots exist
        self.note_label = QLabel()
        self.note_label.setWordWrap(True)
        self.note_label.setStyleSheet("color: #555555;")
        self.summary_label = QLabel("no sample yet")
        self.summary_label.setWordWrap(True)
        self.summary_label.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.glw = pg.GraphicsLayoutWidget()
        self.glw.setBackground("w")
        self.glw.ci.setContentsMargins(4, 2, 4, 0)  # the charts' height goes to the data
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.setSpacing(3)
        layout.addWidget(self.note_label)
        layout.addWidget(self.summary_label)
        layout.addWidget(self.glw, 1)

        dashed = pg.mkPen("#333333", width=1, style=Qt.DashLine)
        self.total_line = pg.InfiniteLine(angle=0, movable=False, pen=dashed, label="",
                                          labelOpts={"position": 0.03, "color": "#333333",
                                                     "anchors": [(0, 0), (0, 0)]})
        self.curves: dict[str, pg.PlotDataItem] = {}
        self.grids: list[Grid] = []
        if self.gpu_mode:
            names = ", ".join(f"GPU {i}: {n}" for i, n in enumerate(self.monitor.gpu_names))
            self.note_label.setText(names)
            self.memory_plot = self._plot(0, "GPU GiB", TIP_GPU_MEM)
            self.lower_plot = self._plot(1, "util %", TIP_GPU_UTIL)
            self.lower_plot.setYRange(0, 100, padding=0.05)
            self.memory_plot.addItem(self.total_line)
            if len(self.monitor.gpu_names) > 1:
                self.memory_plot.addLegend(offset=(-6, -6), labelTextSize="8pt",
                                           labelTextColor="#222222")
            for i in range(len(self.monitor.gpu_names)):
                color = GPU_COLORS[i % len(GPU_COLORS)]
                self.curves[f"gpu{i}"] = self.memory_plot.plot(
                    name=f"GPU {i}", pen=pg.mkPen(color, width=2), fillLevel=0,
                    brush=pg.mkBrush(color + "30"))
                self.curves[f"util{i}"] = self.lower_plot.plot(
                    pen=pg.mkPen(color, width=2), fillLevel=0, brush=pg.mkBrush(color + "30"))
        else:
            # one line: the charts get the height (NVML's reason is a hover away)
            self.note_label.setText("No NVIDIA GPU found: process and system memory")
            self.note_label.setToolTip(f"NVML: {self.monitor.gpu_error}")
            self.memory_plot = self._plot(0, "process GiB", TIP_RSS)
            self.lower_plot = self._plot(1, "system GiB", TIP_SYSTEM)
            self.lower_plot.addItem(self.total_line)
            self.curves["rss"] = self.memory_plot.plot(
                pen=pg.mkPen(palette.ACTIVE_COLOR, width=2), fillLevel=0,
                brush=pg.mkBrush(palette.ACTIVE_COLOR + "30"))
            self.curves["system"] = self.lower_plot.plot(
                pen=pg.mkPen("#666666", width=2), fillLevel=0, brush=pg.mkBrush("#66666630"))
        self.lower_plot.setXLink(self.memory_plot)
        self.memory_plot.hideAxis("bottom")
        self.lower_plot.setLabel("bottom", "seconds ago")
        # the lower chart's share holds its time axis too: the two data areas come out alike
        self.glw.ci.layout.setRowStretchFactor(0, 2)
        self.glw.ci.layout.setRowStretchFactor(1, 3)

        self.timer = QTimer(self)
        self.timer.setInterval(interval_ms)
        self.timer.timeout.connect(self.sample_once)
        if autostart:
            self.start()

    def _plot(self, row: int, label: str, tip: str) -> pg.PlotItem:
        p = self.glw.addPlot(row=row, col=0, enableMenu=False)
        p.setLabel("left", label)
        p.setToolTip(tip)
        p.getAxis("left").setWidth(48)
        p.getAxis("left").enableAutoSIPrefix(False)  # GiB stay GiB (no "x0.001")
        self.grids.append(Grid(p, x=True))  # showGrid costs more than the curves
        p.setMouseEnabled(x=False, y=False)
        return p

    def start(self) -> None:
        self.timer.start()

    def stop(self) -> None:
        """Stop sampling and release NVML (call when the window closes)."""
        self.timer.stop()
        self.monitor.close()

    def sample_once(self) -> DeviceSample:
        """Take one sample, add it to the history, and redraw if the panel is shown."""
        sample = self.monitor.sample()
        self.history.append(sample)
        self._show_summary(sample)
        if self.isVisible():
            self.redraw()
        return sample

    def _show_summary(self, s: DeviceSample) -> None:
        host = (f"process RSS <b>{_gib(s.process_rss)}</b> · system "
                f"<b>{_gib(s.system_used)}</b> of {_gib(s.system_total)} used")
        if self.gpu_mode:
            if not s.gpus:  # NVML failed mid-run: say so, keep the host numbers
                self.summary_label.setText(f"GPU read failed (NVML: {self.monitor.gpu_error}) · "
                                           + host)
                return
            parts = []
            for g in s.gpus:
                mine = "" if g.process_memory is None else \
                    f" (kvscope {_gib(g.process_memory)})"
                parts.append(f"GPU {g.index}: <b>{_gib(g.memory_used)}</b> of "
                             f"{_gib(g.memory_total)} used{mine} · "
                             f"util <b>{g.utilization:.0f}%</b>")
            self.summary_label.setText("<br>".join(parts) + "<br>" + host)
            self.summary_label.setToolTip(TIP_GPU_MEM + "\n" + TIP_GPU_UTIL + "\n" + TIP_RSS)
        else:
            self.summary_label.setText(host)
            self.summary_label.setToolTip(TIP_RSS + "\n" + TIP_SYSTEM)

    def redraw(self) -> None:
        samples = list(self.history.samples)
        if not samples:
            return
        t = np.array([s.t for s in samples]) - samples[-1].t
        if self.gpu_mode:
            for i in range(len(self.monitor.gpu_names)):
                pts = [(x, s.gpus[i]) for x, s in zip(t, samples, strict=True) if len(s.gpus) > i]
                x = np.array([p[0] for p in pts])
                self.curves[f"gpu{i}"].setData(x, [p[1].memory_used / GIB for p in pts])
                self.curves[f"util{i}"].setData(x, [p[1].utilization for p in pts])
            gpus = next((s.gpus for s in reversed(samples) if s.gpus), ())
            total = max((g.memory_total for g in gpus), default=0) / GIB
            self.total_line.label.setFormat(f"total {total:,.1f} GiB")
            self.memory_plot.setYRange(0, max(total, 1e-3) * 1.1, padding=0)
        else:
            rss = np.array([s.process_rss for s in samples]) / GIB
            self.curves["rss"].setData(t, rss)
            self.curves["system"].setData(t, [s.system_used / GIB for s in samples])
            total = samples[-1].system_total / GIB
            self.total_line.label.setFormat(f"total {total:,.1f} GiB")
            self.memory_plot.setYRange(0, max(rss.max(), 1e-3) * 1.25, padding=0)
            self.lower_plot.setYRange(0, max(total, 1e-3) * 1.12, padding=0)
        self.total_line.setValue(total)
        self.memory_plot.setXRange(min(t[0], -10.0), 0, padding=0.02)

    def showEvent(self, event) -> None:  # noqa: N802 - Qt API
        super().showEvent(event)
        self.redraw()
