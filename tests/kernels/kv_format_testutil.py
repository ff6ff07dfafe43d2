"""Paged caches in any KV format, written as the engine writes them: through the torch
reference store, each sequence's context in one pass and then its last token by a decode-step
pass, so that KIVI's open groups sit in the residual as they do at a decode step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscope.engine.kivi_residual import KiviResidual
from kvscope.kernels import kv_formats as kf
from kvscope.kernels import reference
from kvscope.kernels.kv_quant import PackedSide


@dataclass
class FormatCache:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: torch.Tensor  # int32 [batch, blocks + 1]
    lens: torch.Tensor  # int32 [batch]
    k_scale: object  # what a layer passes: a float, a [kv_heads, 1] tensor or a PackedSide
    v_scale: object


def fp8_head_scales(kv_heads: int) -> torch.Tensor:
    return torch.linspace(0.02, 0.05, kv_heads)[:, None]


def build_format_cache(name, lengths, kv_heads, head_dim, block_size, group=None, seed=0,
                       spare_blocks=3) -> FormatCache:
    """Random K/V (unit scale plus an offset, as real keys have) of each sequence in a cache
    of format ``name``, with shuffled block tables; every other byte of the pool (codes and
    scales alike) is garbage, so that reading a wrong slot shows."""
    fmt = kf.kv_format(name, block_size, group)
    gen = torch.Generator().manual_seed(seed)
    need = [(n + block_size - 1) // block_size for n in lengths]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(lengths), max(need) + 1, dtype=torch.int32)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)

    shape = (num_blocks, block_size, kv_heads, fmt.packed_dim(head_dim))
    dtype = fmt.data_dtype(torch.float32)
    k_cache, v_cache = (torch.randint(0, 120, shape, generator=gen, dtype=torch.uint8).view(dtype)
                        if dtype.itemsize == 1 else torch.randn(shape, generator=gen).to(dtype)
                        for _ in range(2))
    metas = [torch.rand((2 if sides == 2 else 1, num_blocks, *rest), generator=gen).to(dt) + 0.5
             for rest, sides, dt in fmt.meta_shapes(block_size, kv_heads, head_dim)]
    residual = None
    if fmt.scheme == "kivi":
        residual = KiviResidual(1, len(lengths), fmt.group, kv_heads, head_dim, torch.float32,
                                torch.device("cpu"))
        residual.k.normal_(generator=gen)

    def sides(plan):
        if fmt.scheme in ("int8", "int4"):
            return PackedSide(fmt, False, (metas[0][0],)), PackedSide(fmt, True, (metas[0][1],))
        if fmt.scheme == "kivi":
            layer = (metas[0][0], metas[1][0])
            return PackedSide(fmt, False, layer, residual.k[0], plan), PackedSide(fmt, True, layer)
        if fmt.scheme == "fp8_per_head":
            return fp8_head_scales(kv_heads), fp8_head_scales(kv_heads) * 2
        if fmt.scheme == "fp8":
            return 0.03, 0.06
        return 1.0, 1.0

    gen = torch.Generator().manual_seed(seed)  # the same K/V in every format
    keys = [torch.randn(n, kv_heads, head_dim, generator=gen) + 0.5 for n in lengths]
    values = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in lengths]
    for decode in (False, True):  # the context but its last token, then a decode step
        spans = [(n - 1, n) if decode else (0, n - 1) for n in lengths]
        plan = None
        if residual is not None:
            plan = residual.plan([(tables[b].tolist(), s, e) for b, (s, e) in enumerate(spans)],
                                 block_size, torch.device("cpu"))
        k_scale, v_scale = sides(plan)
        slots = torch.tensor([int(tables[b, p // block_size]) * block_size + p % block_size
                              for b, (s, e) in enumerate(spans) for p in range(s, e)],
                             dtype=torch.int64)
        if len(slots):
            k = torch.cat([keys[b][s:e] for b, (s, e) in enumerate(spans)])
            v = torch.cat([values[b][s:e] for b, (s, e) in enumerate(spans)])
            reference.store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    return FormatCache(k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32),
                       k_scale, v_scale)
