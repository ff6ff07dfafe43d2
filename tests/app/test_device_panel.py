"""Device monitor (Qt-free) and panel: NVML when a GPU answers, psutil otherwise.

The NVML path is exercised with a fake ``nvml`` module injected into DeviceMonitor."""

from __future__ import annotations

import itertools

import pynvml
import pytest
from image_compare import ARTIFACTS
from PySide6.QtWidgets import QApplication

from kvscope.app.panels.device_panel import DevicePanel
from kvscope.app.workers.device_monitor import DeviceMonitor, DeviceSample, History

GIB = 2**30
SIZE = (640, 400)


class FakeNVML:
    """The part of pynvml the monitor uses, over scripted devices."""

    class NVMLError(Exception):
        pass

    class NVMLError_DriverNotLoaded(NVMLError):  # noqa: N801 - pynvml's naming
        pass

    class NVMLError_GpuIsLost(NVMLError):  # noqa: N801
        pass

    def __init__(self, names=("NVIDIA H200",), total=141 * GIB, init_error=None, pid=None):
        self.names, self.total, self.init_error, self.pid = names, total, init_error, pid
        self.used = [10 * GIB] * len(names)
        self.util = [0.0] * len(names)
        self.lost = False
        self.shutdowns = 0

    def nvmlInit(self):  # noqa: N802 - pynvml API names
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):  # noqa: N802
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):  # noqa: N802
        return len(self.names)

    def nvmlDeviceGetHandleByIndex(self, i):  # noqa: N802
        return i

    def nvmlDeviceGetName(self, h):  # noqa: N802
        return self.names[h].encode()  # older pynvml returns bytes

    def nvmlDeviceGetMemoryInfo(self, h):  # noqa: N802
        if self.lost:
            raise self.NVMLError_GpuIsLost("GPU is lost")
        return type("Mem", (), {"total": self.total, "used": self.used[h],
                                "free": self.total - self.used[h]})()

    def nvmlDeviceGetUtilizationRates(self, h):  # noqa: N802
        return type("Util", (), {"gpu": self.util[h], "memory": 0})()

    def nvmlDeviceGetComputeRunningProcesses(self, h):  # noqa: N802
        proc = type("Proc", (), {"pid": self.pid, "usedGpuMemory": 3 * GIB})()
        other = type("Proc", (), {"pid": -1, "usedGpuMemory": 5 * GIB})()
        return [proc, other]


def clock(step: float = 0.5):
    counter = itertools.count()
    return lambda: next(counter) * step


# ------------------------------------------------------------------------ monitor (no Qt)
def test_monitor_reads_nvml_numbers():
    fake = FakeNVML(names=("NVIDIA H200", "NVIDIA H200"))
    monitor = DeviceMonitor(nvml=fake, clock=clock())
    fake.pid = monitor.process.pid
    assert monitor.has_gpu and monitor.gpu_error is None
    assert monitor.gpu_names == ["NVIDIA H200", "NVIDIA H200"]
    fake.used, fake.util = [40 * GIB, 1 * GIB], [87.0, 0.0]
    s = monitor.sample()
    assert [(g.index, g.memory_used, g.memory_total, g.utilization) for g in s.gpus] == [
        (0, 40 * GIB, 141 * GIB, 87.0), (1, 1 * GIB, 141 * GIB, 0.0)]
    assert s.gpus[0].process_memory == 3 * GIB  # only this process's entry counts
    assert s.process_rss > 0 and 0 < s.system_used < s.system_total
    monitor.close()
    assert fake.shutdowns == 1 and not monitor.has_gpu
    monitor.close()
    assert fake.shutdowns == 1


def test_monitor_counts_the_engine_child_process_in_the_app_memory():
    import contextlib
    import subprocess
    import sys
    import time

    import psutil

    monitor = DeviceMonitor(nvml=FakeNVML(names=("NVIDIA H200",)), clock=clock())
    size = 300 * 2**20
    child = subprocess.Popen([sys.executable, "-c", f"b = bytearray({size}); import time; "
                              "print('ready', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    own = monitor.process.memory_info
    try:
        assert child.stdout.readline().strip() == "ready"
        monitor.nvml.pid = child.pid  # the engine process holds the GPU memory
        child_rss = psutil.Process(child.pid).memory_info().rss
        assert child_rss > size
        before = own().rss  # other threads of this worker move its memory: read it either side
        s = monitor.sample()
        assert s.process_rss - min(before, own().rss) > 0.9 * size
        assert s.gpus[0].process_memory == 3 * GIB
    finally:
        child.kill()
        child.wait()
    time.sleep(0.1)

    def rest() -> int:  # this worker and the children it still has (a zygote of earlier tests)
        total = own().rss
        for c in monitor.process.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                total += c.memory_info().rss
        return total

    before = rest()
    s = monitor.sample()
    assert s.process_rss - max(before, rest()) < 0.5 * size  # it stops counting once gone
    monitor.close()


def test_monitor_catches_nvml_errors_at_init_and_while_sampling():
    fake = FakeNVML(init_error=FakeNVML.NVMLError_DriverNotLoaded("Driver Not Loaded"))
    monitor = DeviceMonitor(nvml=fake)
    assert not monitor.has_gpu
    assert monitor.gpu_error == "Driver Not Loaded"
    s = monitor.sample()
    assert s.gpus == () and s.process_rss > 0

    fake = FakeNVML()
    monitor = DeviceMonitor(nvml=fake)
    fake.lost = True
    assert monitor.sample().gpus == ()
    assert monitor.gpu_error == "GPU is lost"
    fake.lost = False
    assert len(monitor.sample().gpus) == 1 and monitor.gpu_error is None

    assert DeviceMonitor(nvml=FakeNVML(names=())).gpu_error == "no devices found"


def test_the_real_pynvml_error_base_class_is_caught():
    class NoLibrary(FakeNVML):
        NVMLError = pynvml.NVMLError

        def nvmlInit(self):  # noqa: N802
            raise pynvml.NVMLError_LibraryNotFound()

    monitor = DeviceMonitor(nvml=NoLibrary())
    assert not monitor.has_gpu and "Library Not Found" in monitor.gpu_error


def test_history_keeps_the_last_ten_minutes():
    history = History(seconds=600, interval_s=0.5)
    for i in range(3000):
        history.append(DeviceSample(i * 0.5, (), 1, 1, 2))
    assert len(history) <= 1201
    assert history.latest.t - history.samples[0].t <= 600


# ------------------------------------------------------------------------------- panel
def test_panel_on_this_machine(qtbot):
    """Here (no NVIDIA GPU) the panel says so and shows process memory; on a GPU machine it
    shows the GPU."""
    panel = DevicePanel(interval_ms=500)
    qtbot.addWidget(panel)
    panel.resize(*SIZE)
    panel.show()
    s = panel.sample_once()
    assert s.process_rss > 0
    if panel.monitor.has_gpu:
        assert "GPU 0" in panel.summary_label.text()
    else:
        assert panel.note_label.text() == "No NVIDIA GPU found: process and system memory"
        assert panel.note_label.toolTip().startswith("NVML: ")
        assert f"process RSS <b>{s.process_rss / GIB:,.2f} GiB</b>" in panel.summary_label.text()
        x, y = panel.curves["rss"].getData()
        assert y[-1] == pytest.approx(s.process_rss / GIB) and y[-1] > 0
    assert panel.timer.isActive()
    panel.stop()
    assert not panel.timer.isActive()


def test_panel_without_gpu_screenshot(qtbot):
    fake = FakeNVML(init_error=FakeNVML.NVMLError_DriverNotLoaded("Driver Not Loaded"))
    panel = DevicePanel(DeviceMonitor(nvml=fake, clock=clock()), autostart=False)
    qtbot.addWidget(panel)
    panel.resize(*SIZE)
    panel.show()
    for _ in range(40):
        panel.sample_once()
    assert len(panel.history) == 40
    assert panel.note_label.text() == "No NVIDIA GPU found: process and system memory"
    assert panel.note_label.toolTip() == "NVML: Driver Not Loaded"
    x, y = panel.curves["rss"].getData()
    assert len(x) == 40 and x[-1] == 0 and x[0] == pytest.approx(-19.5) and min(y) > 0
    assert panel.total_line.value() == pytest.approx(panel.history.latest.system_total / GIB)
    save(panel, "device_panel")


def test_panel_with_gpu_shows_nvml_numbers(qtbot):
    fake = FakeNVML()
    monitor = DeviceMonitor(nvml=fake, clock=clock())
    fake.pid = monitor.process.pid
    panel = DevicePanel(monitor, autostart=False)
    qtbot.addWidget(panel)
    panel.resize(*SIZE)
    panel.show()
    assert panel.note_label.text() == "GPU 0: NVIDIA H200"
    for i in range(117):  # a model loads, then decode bursts
        fake.used = [(10 + min(i, 20) * 3) * GIB]
        fake.util = [0.0 if i < 20 else (95.0 if i % 10 < 7 else 5.0)]
        panel.sample_once()
    text = panel.summary_label.text()
    assert "GPU 0: <b>70.00 GiB</b> of 141.00 GiB used (kvscope 3.00 GiB)" in text
    assert "util <b>95%</b>" in text
    x, y = panel.curves["gpu0"].getData()
    assert y[-1] == pytest.approx(70.0) and y[0] == pytest.approx(10.0)
    assert panel.curves["util0"].getData()[1][-1] == 95.0
    assert panel.total_line.value() == pytest.approx(141.0)
    save(panel, "device_panel_gpu")
    fake.lost = True
    panel.sample_once()
    assert "GPU read failed (NVML: GPU is lost)" in panel.summary_label.text()
    panel.stop()
    assert fake.shutdowns == 1


def save(panel, name: str) -> None:
    QApplication.processEvents()  # let the layout take the summary's new height
    image = panel.grab().toImage()
    assert (image.width(), image.height()) == SIZE
    ARTIFACTS.mkdir(exist_ok=True)
    image.save(str(ARTIFACTS / f"{name}.png"))
