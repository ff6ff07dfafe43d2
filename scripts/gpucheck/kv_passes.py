"""Forward passes' stores and attention on a quantized KV cache, as the model runner makes them
(one layer, no model): each backend owns its cache, its scales beside the blocks and KIVI's
residual, so a check compares what two backends store and read over the same passes (the
formats section here, and tests/kernels/test_triton_kv_formats.py on the CPU)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

from kvscope.engine.kivi_residual import KiviResidual
from kvscope.kernels import kernel_backend
from kvscope.kernels import kv_formats as kf
from kvscope.kernels.kv_quant import PackedSide


@dataclass
class World:
    """One backend's KV state of one layer."""

    backend: object
    fmt: kf.KVFormat
    cache: torch.Tensor  # [2, num_blocks, block_size, kv_heads, packed]
    meta: tuple
    residual: KiviResidual | None
    scales: tuple = (1.0, 1.0)  # fp8 (per layer or [kv_heads, 1] per head)
    outputs: list = field(default_factory=list)

    @classmethod
    def make(cls, impl, name, num_blocks, block_size, kv_heads, head_dim, dtype, group=None,
             scales=(1.0, 1.0), device="cpu", max_seqs=4):
        device = torch.device(device)
        fmt = kf.kv_format(name, block_size, group)
        shape = (2, num_blocks, block_size, kv_heads, fmt.packed_dim(head_dim))
        cache = torch.zeros(shape, dtype=fmt.data_dtype(dtype), device=device)
        meta = tuple(torch.zeros((sides, num_blocks, *rest), dtype=t, device=device)
                     for rest, sides, t in fmt.meta_shapes(block_size, kv_heads, head_dim))
        residual = KiviResidual(1, max_seqs, fmt.group, kv_heads, head_dim, dtype,
                                device) if fmt.scheme == "kivi" else None
        scales = tuple(s.to(device) if isinstance(s, torch.Tensor) else s for s in scales)
        return cls(kernel_backend(impl, device), fmt, cache, meta, residual, scales)

    def sides(self, plan):
        if not self.fmt.is_packed:
            return self.scales
        if self.residual is None:
            return (PackedSide(self.fmt, False, (self.meta[0][0],)),
                    PackedSide(self.fmt, True, (self.meta[0][1],)))
        layer = (self.meta[0][0], self.meta[1][0])
        return (PackedSide(self.fmt, False, layer, self.residual.k[0], plan),
                PackedSide(self.fmt, True, layer))

    def store(self, p: Pass):
        """Store the pass's K/V; returns the sides its attention reads with."""
        plan = None
        if self.residual is not None:
            plan = self.residual.plan([(t, s, e) for t, s, e in
                                       zip(p.tables, p.starts, p.ends, strict=True)],
                                      self.cache.shape[2], self.cache.device)
        sides = self.sides(plan)
        self.backend.store_kv(p.k, p.v, self.cache[0], self.cache[1], p.slots, *sides)
        return sides

    def attend(self, p: Pass, sides, window=None, softcap=None, num_splits=None):
        ks, vs = sides
        k_cache, v_cache = self.cache[0], self.cache[1]
        b = self.backend
        scale = 1 / math.sqrt(p.q.shape[-1])
        if p.is_decode:
            return b.paged_decode_attention(p.q, k_cache, v_cache, p.table_tensor, p.ctx, scale,
                                            ks, vs, max(p.ends), num_splits=num_splits,
                                            window=window, softcap=softcap)
        return b.paged_prefill_attention(p.q, k_cache, v_cache, p.table_tensor, p.cu, p.ctx,
                                         scale, ks, vs, max(p.lens), window=window,
                                         softcap=softcap)

    def run(self, p: Pass, **attend):
        out = self.attend(p, self.store(p), **attend)
        self.outputs.append(out)
        return out


@dataclass
class Pass:
    tables: list
    starts: list
    ends: list
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    block_size: int

    def _up(self, values, dtype=torch.int64):
        return torch.tensor(values, dtype=dtype, device=self.q.device)

    @property
    def lens(self):
        return [e - s for s, e in zip(self.starts, self.ends, strict=True)]

    @property
    def is_decode(self):
        return all(n == 1 for n in self.lens)

    @property
    def slots(self):
        bs = self.block_size
        return self._up([t[p // bs] * bs + p % bs for t, s, e in
                         zip(self.tables, self.starts, self.ends, strict=True)
                         for p in range(s, e)])

    @property
    def table_tensor(self):
        width = max(len(t) for t in self.tables) + 1
        return self._up([t + [0] * (width - len(t)) for t in self.tables], torch.int32)

    @property
    def ctx(self):
        return self._up(self.ends, torch.int32)

    @property
    def cu(self):
        return self._up([0, *torch.tensor(self.lens).cumsum(0).tolist()], torch.int32)


def passes(schedule, heads, kv_heads, head_dim, block_size, num_blocks, dtype, seed=0,
           device="cpu"):
    """``schedule``: per pass, the new tokens of each sequence (0: not in the pass). Random
    q/k/v (k with a per-channel offset, as real keys have) and shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    num_seqs = len(schedule[0])
    tables, done = [[] for _ in range(num_seqs)], [0] * num_seqs
    offset = torch.randn(kv_heads, head_dim, generator=gen) * 2
    out = []
    for step in schedule:
        seqs = [b for b in range(num_seqs) if step[b]]
        for b in seqs:
            while len(tables[b]) * block_size < done[b] + step[b]:
                tables[b].append(free.pop())
        t = sum(step)
        q = torch.randn(t, heads, head_dim, generator=gen).to(device, dtype)
        k = (torch.randn(t, kv_heads, head_dim, generator=gen) + offset).to(device, dtype)
        v = torch.randn(t, kv_heads, head_dim, generator=gen).to(device, dtype)
        out.append(Pass([list(tables[b]) for b in seqs], [done[b] for b in seqs],
                        [done[b] + step[b] for b in seqs], q, k, v, block_size))
        for b in seqs:
            done[b] += step[b]
    return out
