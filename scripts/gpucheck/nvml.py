"""NVML read as the Device panel reads it, checked against what torch sees."""

from __future__ import annotations

import os
from dataclasses import asdict

import torch

from gpucheck.plan import Plan
from gpucheck.report import Report
from kvscope.app.workers.nvml import NvmlReader


def check_nvml(report: Report, plan: Plan, device) -> None:
    reader = NvmlReader()
    try:
        if not reader.has_gpu:
            report.add("nvml", "Device panel reading", None if device.type != "cuda" else False,
                       f"no GPU view (NVML: {reader.gpu_error})")
            return
        keep = torch.empty(2**28, dtype=torch.uint8, device=device)  # 256 MiB held by us
        gpus = reader.read_gpus({os.getpid()})
        for g in gpus:
            mine = "n/a" if g.process_memory is None else f"{g.process_memory / 2**30:.2f} GiB"
            value = (f"{g.name}: {g.memory_used / 2**30:.1f}/{g.memory_total / 2**30:.1f} GiB, "
                     f"util {g.utilization:.0f}%, this process {mine}")
            ok = None
            if device.type == "cuda" and g.index == (device.index or 0):
                free, total = torch.cuda.mem_get_info(device)
                used = total - free
                ok = abs(g.memory_total - total) < 2**30 and abs(g.memory_used - used) < 2**30
                value += f"; torch sees {used / 2**30:.1f} GiB used"
            report.add("nvml", f"GPU {g.index}", ok, value, "NVML used ~ torch used (1 GiB)",
                       asdict(g))
        del keep
        if not gpus:
            report.add("nvml", "read", False, f"read failed (NVML: {reader.gpu_error})")
    finally:
        reader.close()
