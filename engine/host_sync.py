"""Catching host synchronisation in a forward pass (a debugging and test aid).

On CUDA, torch's sync debug mode raises on every synchronising call. On the CPU there is nothing
to wait for, so a torch-function mode raises instead on the calls that would read a tensor's
values back to the host (``item``, ``tolist``, ``int()``, ``bool()``, ``nonzero``): the same
mistakes, caught by CPU tests and by ``scripts/gpu_check.py --cpu-dry-run``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

READ_BACKS = frozenset({
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__, torch.Tensor.__index__,
    torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.nonzero, torch.nonzero,
})


class HostSyncError(RuntimeError):
    """A tensor value was read back to the host where none may be."""


class _ForbidReadBack(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READ_BACKS:
            raise HostSyncError(f"read back from the device: {func.__name__}")
        return func(*args, **(kwargs or {}))


@contextmanager
def no_host_sync(device: str | torch.device) -> Iterator[None]:
    """Raise on any host synchronisation inside the block (a ``RuntimeError`` on CUDA)."""
    if torch.device(device).type == "cuda":
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    else:
        with _ForbidReadBack():
            yield
