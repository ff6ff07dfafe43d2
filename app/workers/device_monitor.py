"""What the device is doing: GPU memory and utilisation from NVML where an NVIDIA GPU is present,
otherwise the app's resident memory and the system's memory (psutil). The app is this
process and its children: the engine runs in a child process. Qt-free: the Device
panel samples it from a timer; tests inject a fake ``nvml`` module. The NVML half lives in
``nvml_reader`` (no psutil), which ``scripts/gpu_check.py`` shares.

Every call here is cheap (NVML queries and /proc reads, well under a millisecond)."""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from dataclasses import dataclass

import psutil

from kvscope.app.workers.nvml import GpuSample, NvmlReader


@dataclass(frozen=True)
class DeviceSample:
    t: float  # monotonic seconds
    gpus: tuple[GpuSample, ...]
    process_rss: int  # bytes of the app (this process and its children) resident in RAM
    system_used: int  # bytes of host memory in use (total - available)
    system_total: int  # bytes


class DeviceMonitor(NvmlReader):
    """Reads the device: the GPUs through NVML (see ``NvmlReader``) plus host memory."""

    def __init__(self, nvml=None, pid: int | None = None, clock=time.monotonic):
        self.clock = clock
        self.process = psutil.Process(pid or os.getpid())
        super().__init__(nvml)

    def sample(self) -> DeviceSample:
        vm = psutil.virtual_memory()
        procs = self._app_processes()
        rss = 0
        for p in procs:
            with contextlib.suppress(psutil.Error):  # a child may exit between the calls
                rss += p.memory_info().rss
        return DeviceSample(self.clock(), self.read_gpus({p.pid for p in procs}), rss,
                            vm.total - vm.available, vm.total)

    def _app_processes(self) -> list[psutil.Process]:
        try:
            return [self.process, *self.process.children(recursive=True)]
        except psutil.Error:
            return [self.process]


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

