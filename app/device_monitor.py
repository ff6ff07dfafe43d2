"""What the device is doing: GPU memory and utilisation from NVML where an NVIDIA GPU is present,
otherwise the app's resident memory and the system's memory (psutil). The app is this
process and its children: the engine runs in a child process. Qt-free: the Device
panel samples it from a timer; tests inject a fake ``nvml`` module.

Every call here is cheap (NVML queries and /proc reads, well under a millisecond)."""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class GpuSample:
    index: int
    name: str
    memory_used: int  # bytes in use on the device, by all processes
    memory_total: int  # bytes
    utilization: float  # percent of the last sample period a kernel was running
    process_memory: int | None  # bytes the app holds on the device (None: not reported)


@dataclass(frozen=True)
class DeviceSample:
    t: float  # monotonic seconds
    gpus: tuple[GpuSample, ...]
    process_rss: int  # bytes of the app (this process and its children) resident in RAM
    system_used: int  # bytes of host memory in use (total - available)
    system_total: int  # bytes


class DeviceMonitor:
    """Reads the device. ``gpu_error`` says why there is no GPU view (None when there is)."""

    def __init__(self, nvml=None, pid: int | None = None, clock=time.monotonic):
        self.clock = clock
        self.process = psutil.Process(pid or os.getpid())
        self.nvml = nvml
        self.gpu_error: str | None = None
        self.handles: list = []
        self.gpu_names: list[str] = []
        if self.nvml is None:
            try:
                import pynvml as nvml_module
            except ImportError as e:  # nvidia-ml-py is a dependency, but be graceful
                self.gpu_error = f"pynvml not importable: {e}"
                return
            self.nvml = nvml_module
        self._init_nvml()

    def _init_nvml(self) -> None:
        nv = self.nvml
        try:
            nv.nvmlInit()
        except nv.NVMLError as e:
            self.gpu_error = _reason(e)
            self.nvml = None
            return
        try:
            count = nv.nvmlDeviceGetCount()
            self.handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self.gpu_names = [_text(nv.nvmlDeviceGetName(h)) for h in self.handles]
        except nv.NVMLError as e:
            self.gpu_error = _reason(e)
            self.handles = []
        if not self.handles:
            self.gpu_error = self.gpu_error or "no devices found"
            self.close()

    @property
    def has_gpu(self) -> bool:
        return bool(self.handles)

    def sample(self) -> DeviceSample:
        vm = psutil.virtual_memory()
        procs = self._app_processes()
        rss = 0
        for p in procs:
            with contextlib.suppress(psutil.Error):  # a child may exit between the calls
                rss += p.memory_info().rss
        return DeviceSample(self.clock(), self._gpus({p.pid for p in procs}), rss,
                            vm.total - vm.available, vm.total)

    def _app_processes(self) -> list[psutil.Process]:
        try:
            return [self.process, *self.process.children(recursive=True)]
        except psutil.Error:
            return [self.process]

    def _gpus(self, pids: set[int]) -> tuple[GpuSample, ...]:
        if not self.handles:
            return ()
        nv, out = self.nvml, []
        try:
            for i, h in enumerate(self.handles):
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                util = nv.nvmlDeviceGetUtilizationRates(h)
                out.append(GpuSample(i, self.gpu_names[i], int(mem.used), int(mem.total),
                                     float(util.gpu), self._process_memory(h, pids)))
        except nv.NVMLError as e:  # a device lost or a driver reset: report, keep sampling
            self.gpu_error = _reason(e)
            return ()
        self.gpu_error = None
        return tuple(out)

    def _process_memory(self, handle, pids: set[int]) -> int | None:
        try:
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except (self.nvml.NVMLError, AttributeError):
            return None
        used = [p.usedGpuMemory for p in procs if p.pid in pids]
        return int(sum(u for u in used if u is not None)) if used else 0

    def close(self) -> None:
        """Release NVML (once); sampling goes on with host memory only."""
        if self.nvml is not None:
            with contextlib.suppress(self.nvml.NVMLError):
                self.nvml.nvmlShutdown()
            self.nvml = None
        self.handles = []


class History:
    """The last ``seconds`` of samples (bounded: old samples fall off)."""

    def __init__(self, seconds: float = 600.0, interval_s: float = 0.5):
        self.seconds = seconds
        self.samples: deque[DeviceSample] = deque(maxlen=int(seconds / interval_s) + 1)

    def append(self, sample: DeviceSample) -> None:
        self.samples.append(sample)
        while sample.t - self.samples[0].t > self.seconds:
            self.samples.popleft()

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def latest(self) -> DeviceSample | None:
        return self.samples[-1] if self.samples else None


def _reason(error: Exception) -> str:
    text = str(error).strip()
    return text or type(error).__name__


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
