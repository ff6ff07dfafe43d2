"""How long a step's forward pass took, without making the host wait for the device."""

from __future__ import annotations

import time

import torch


class ForwardTimer:
    """Forward-pass time: a monotonic clock on the CPU; CUDA events on the GPU. Read it after
    sampling: sampling's one transfer has waited for the forward pass by then, so reading adds no
    synchronisation (only a step that samples nothing, a middle prompt chunk, waits here)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
        else:
            self.seconds_ = time.perf_counter() - self.t0

    def seconds(self) -> float:
        if not self.cuda:
            return self.seconds_
        if not self.end.query():  # nothing sampled in this step: wait for the pass to end
            self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3
