"""The torch reference store and read of the formats with scales beside the block
(``kv_formats``: int8/int4 per token and head, KIVI): quantize at write time, dequantize the
gathered blocks only.

The kernels receive a ``PackedSide`` where the plain formats get a scale: the format, this
layer's tensors beside the blocks (block index first) and, for KIVI's K, the residual rows and
the forward pass's ``ResidualPlan``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscope.kernels import kv_formats as kf


@dataclass
class ResidualPlan:
    """Where one forward pass's KIVI K goes (built on the host; one per KV-cache group).

    Rows index this layer's residual ``[slots * (G - 1), kv_heads, head_dim]``; a source row
    ``r >= len(residual)`` is the pass's new token ``r - len(residual)``."""

    write_tokens: torch.Tensor  # int64 [W]: new tokens of a group still open after the pass
    write_rows: torch.Tensor  # int64 [W]: their residual rows
    group_blocks: torch.Tensor  # int64 [NG]: the block of each group completed in the pass
    group_index: torch.Tensor  # int64 [NG]: its index within the block
    group_sources: torch.Tensor  # int64 [NG, G]: its G tokens' source rows
    open_groups: list[tuple[int, int, int, int]]  # (sequence, first position, first row, n)
    # per sequence: (first position of the group its pass starts in, source rows from there on)
    recent: list[tuple[int, torch.Tensor]] | None = None
    # int64 [B, 2]: per sequence, (first position of recent, its first row in recent's order)
    recent_index: torch.Tensor | None = None


@dataclass
class PackedSide:
    fmt: kf.KVFormat
    is_value: bool
    meta: tuple[torch.Tensor, ...]  # this layer's, block index first
    residual: torch.Tensor | None = None  # KIVI K: [slots * (G - 1), kv_heads, head_dim]
    plan: ResidualPlan | None = None
    source: torch.Tensor | None = None  # KIVI K: the residual and the pass's new K, at store
    # KIVI K, the triton store's: the keys full_precision_k reads, all sequences packed, and
    # plan.recent_index (triton_store_packed.recent_keys)
    recent_k: tuple[torch.Tensor, torch.Tensor] | None = None


def store(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, side: PackedSide) -> None:
    """Write ``x`` [T, kv_heads, d] to the cache ``[num_blocks, block_size, kv_heads, packed]``
    at ``slots`` (slot -1 skipped)."""
    fmt = side.fmt
    if fmt.scheme == "kivi" and not side.is_value:
        _store_kivi_k(x, cache, side)
        return
    keep = (slots >= 0).nonzero().squeeze(1)
    if keep.numel() != slots.numel():
        x, slots = x.index_select(0, keep), slots.index_select(0, keep)
    if fmt.scheme == "int8":
        q, meta = kf.quantize_int8(x)
    elif fmt.scheme == "int4":
        q, meta = kf.quantize_int4(x)
    else:
        q, meta = kf.quantize_kivi_v(x, fmt.bits)
    flat = cache.view(-1, *cache.shape[2:])
    flat.index_copy_(0, slots.long(), q)
    side_meta = side.meta[-1]
    side_meta.view(-1, *side_meta.shape[2:]).index_copy_(0, slots.long(), meta)


def _store_kivi_k(x: torch.Tensor, cache: torch.Tensor, side: PackedSide) -> None:
    plan, res = side.plan, side.residual
    # Each completed group's G tokens (the residual's, then the new ones), taken before the
    # open groups overwrite residual rows; kept for the pass's attention (full_precision_k).
    side.source = source = torch.cat((res, x.to(res.dtype)))
    if plan.group_blocks.numel():
        groups = source.index_select(0, plan.group_sources.view(-1))
        g = side.fmt.group
        q, meta = kf.quantize_kivi_k(groups.view(-1, g, *x.shape[1:]), side.fmt.bits)
        grouped = cache.view(cache.shape[0], -1, g, *cache.shape[2:])
        grouped[plan.group_blocks, plan.group_index] = q
        side.meta[0][plan.group_blocks, plan.group_index] = meta
    if plan.write_tokens.numel():
        res.index_copy_(0, plan.write_rows, x.index_select(0, plan.write_tokens).to(res.dtype))


def read_blocks(cache: torch.Tensor, blocks: torch.Tensor, side: PackedSide) -> torch.Tensor:
    """The blocks' values as float32 [n, block_size, kv_heads, head_dim] (KIVI K: positions in
    an open group are not valid here; ``overlay_residual`` puts them)."""
    fmt = side.fmt
    codes = cache.index_select(0, blocks)
    meta = [m.index_select(0, blocks) for m in side.meta]
    if fmt.scheme == "int8":
        return kf.dequantize_int8(codes, meta[0])
    if fmt.scheme == "int4":
        return kf.dequantize_int4(codes, meta[0])
    if side.is_value:
        return kf.dequantize_kivi(codes, meta[1][..., None, :], fmt.bits)
    n, bs = codes.shape[:2]
    grouped = codes.view(n, bs // fmt.group, fmt.group, *codes.shape[2:])
    out = kf.dequantize_kivi(grouped, meta[0][:, :, None], fmt.bits)
    return out.view(n, bs, *out.shape[3:])


def overlay_residual(values: torch.Tensor, side: PackedSide, seq: int | None = None) -> None:
    """Put the full-precision K of open KIVI groups over ``values``: [positions, kv_heads, d] of
    sequence ``seq``, or [batch, positions, kv_heads, d] for every sequence (``seq`` None)."""
    if side.plan is None or side.is_value:
        return
    for b, first, row, n in side.plan.open_groups:
        if seq is None:
            values[b, first:first + n] = side.residual[row:row + n]
        elif b == seq:
            values[first:first + n] = side.residual[row:row + n]


def full_precision_k(side: PackedSide, seq: int) -> tuple[int, torch.Tensor] | None:
    """KIVI: (g, K) with K the full-precision keys of sequence ``seq`` from position g (the
    start of the group its pass begins in) to its end; None for other formats. A query at
    position p reads the keys of its own group in full precision unless p completes it, the
    rest quantized: what a decode step reads, so a prefill reads what decode steps would."""
    if side.plan is None or side.is_value:
        return None
    first, rows = side.plan.recent[seq]
    return first, side.source.index_select(0, rows)
