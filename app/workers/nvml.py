"""GPU memory and utilisation from NVML, as the Device panel shows them. Needs only the
``pynvml`` module (nvidia-ml-py): no Qt, no psutil, so ``scripts/gpu_check.py`` reads the GPU
the same way on a machine that has neither. Tests inject a fake ``nvml`` module."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSample:
    index: int
    name: str
    memory_used: int  # bytes in use on the device, by all processes
    memory_total: int  # bytes
    utilization: float  # percent of the last sample period a kernel was running
    process_memory: int | None  # bytes the given processes hold on the device (None: not reported)


class NvmlReader:
    """Reads the GPUs. ``gpu_error`` says why there is no GPU view (None when there is)."""

    def __init__(self, nvml=None):
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

    def read_gpus(self, pids: set[int]) -> tuple[GpuSample, ...]:
        """One sample per GPU; ``process_memory`` sums what the processes ``pids`` hold."""
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
        """Release NVML (once)."""
        if self.nvml is not None:
            with contextlib.suppress(self.nvml.NVMLError):
                self.nvml.nvmlShutdown()
            self.nvml = None
        self.handles = []


def _reason(error: Exception) -> str:
    text = str(error).strip()
    return text or type(error).__name__


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
