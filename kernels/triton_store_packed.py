"""Triton stores of the formats with scales beside the block (kv_formats: int8/int4 per token
and head, KIVI): quantize at write time, the codes into the packed block and the scales (and
zero points) beside it, with the reference's math (kv_quant.store) operation for operation.

Divisions are IEEE (``div_rn``: a GPU's ``/`` is approximate) and the launches disable FMA
contraction, so the bytes equal the reference's on a GPU too. Sub-byte codes are packed along
head_dim, element ``i`` of a byte at bits ``BITS * i``: the tile of packed bytes is built from
``8 / BITS`` strided loads of the values (dims ``PER * j + i``). int4's randomized Hadamard
rotation of the new tokens is torch's (``kv_formats.rht``), as vLLM's store does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscope.kernels import kv_formats as kf
from kvscope.kernels.kv_quant import PackedSide

SYM8, ASYM_ZP4, KIVI_V = 0, 1, 2  # SCHEME: int8, int4, KIVI's V (per token and head)
_NO_FUSION = {"enable_fp_fusion": False}


@triton.jit
def _round_half_away(x):
    return tl.where(x >= 0, tl.floor(x + 0.5), tl.math.ceil(x - 0.5))


@triton.jit
def _round_half_even(x):
    # torch.round; add-only (no contraction), exact for |x| < 2^22
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _store_per_token_kernel(
    x_ptr, cache_ptr, meta_ptr, slot_ptr, stride_xt, stride_xh,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BITS: tl.constexpr, SCHEME: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """One token's heads: a scale (and zero point) per head over its head_dim values."""
    PER: tl.constexpr = 8 // BITS
    PACKED: tl.constexpr = HEAD_DIM // PER
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_P)
    mask = (heads[:, None] < KV_HEADS) & (cols[None, :] < PACKED)
    src = x_ptr + token * stride_xt + heads[:, None] * stride_xh + cols[None, :] * PER
    lo = tl.full([BLOCK_H], float("inf"), tl.float32)
    hi = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for i in tl.static_range(PER):
        x = tl.load(src + i, mask=mask, other=0.0).to(tl.float32)
        lo = tl.minimum(lo, tl.min(tl.where(mask, x, float("inf")), axis=1))
        hi = tl.maximum(hi, tl.max(tl.where(mask, x, float("-inf")), axis=1))
    h_mask = heads < KV_HEADS
    meta_row = slot * KV_HEADS + heads
    if SCHEME == 0:
        scale = tl.maximum(tl.math.div_rn(tl.maximum(hi, -lo), 127.0), 1e-6)
        inv = tl.math.div_rn(1.0, scale)
        tl.store(meta_ptr + meta_row, scale, mask=h_mask)
    elif SCHEME == 1:
        scale = tl.maximum(tl.math.div_rn(hi - lo, 15.0), 1e-6)
        inv = tl.math.div_rn(1.0, scale)
        zp = tl.clamp(_round_half_away(tl.math.div_rn(-lo, scale)), 0.0, 15.0)
        packed = (scale.to(tl.int32, bitcast=True) & -16) | zp.to(tl.int32)
        tl.store(meta_ptr + meta_row, packed.to(tl.float32, bitcast=True), mask=h_mask)
    else:
        qmax: tl.constexpr = (1 << BITS) - 1
        scale = tl.maximum(tl.math.div_rn(hi - lo, qmax * 1.0), 1e-5).to(tl.float16)
        zero = lo.to(tl.float16)
        tl.store(meta_ptr + meta_row * 2, scale, mask=h_mask)
        tl.store(meta_ptr + meta_row * 2 + 1, zero, mask=h_mask)
        scale, zero = scale.to(tl.float32), zero.to(tl.float32)
    out = tl.zeros([BLOCK_H, BLOCK_P], tl.int32)
    for i in tl.static_range(PER):
        x = tl.load(src + i, mask=mask, other=0.0).to(tl.float32)
        if SCHEME == 0:
            out = tl.clamp(_round_half_away(x * inv[:, None]), -128.0, 127.0).to(tl.int32)
        elif SCHEME == 1:
            q = tl.clamp(_round_half_away(x * inv[:, None] + zp[:, None]), 0.0, 15.0)
            out |= q.to(tl.int32) << (BITS * i)
        else:
            q = _round_half_even(tl.math.div_rn(x - zero[:, None], scale[:, None]))
            out |= tl.clamp(q, 0.0, qmax * 1.0).to(tl.int32) << (BITS * i)
    dst = cache_ptr + slot * (KV_HEADS * PACKED) + heads[:, None] * PACKED + cols[None, :]
    tl.store(dst, out.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kivi_k_kernel(
    res_ptr, x_ptr, cache_ptr, meta_ptr, blocks_ptr, index_ptr, sources_ptr, base,
    stride_rt, stride_rh, stride_xt, stride_xh,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BITS: tl.constexpr, PAGE: tl.constexpr,
    G: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """One completed K group of one head: a scale and zero per channel over its G tokens, read
    from the residual (source row < base) or the pass's new keys."""
    PER: tl.constexpr = 8 // BITS
    PACKED: tl.constexpr = HEAD_DIM // PER
    qmax: tl.constexpr = (1 << BITS) - 1
    group = tl.program_id(0)
    head = tl.program_id(1)
    block = tl.load(blocks_ptr + group)
    index = tl.load(index_ptr + group)
    rows = tl.load(sources_ptr + group * G + tl.arange(0, G))
    in_res = rows < base
    cols = tl.arange(0, BLOCK_P)
    c_mask = cols < PACKED
    res_src = res_ptr + tl.where(in_res, rows, 0)[:, None] * stride_rt + head * stride_rh
    new_src = x_ptr + tl.where(in_res, 0, rows - base)[:, None] * stride_xt + head * stride_xh
    meta = meta_ptr + (((block * (PAGE // G) + index) * KV_HEADS + head) * HEAD_DIM) * 2
    dst = cache_ptr + ((block * PAGE + index * G + tl.arange(0, G)) * KV_HEADS + head) * PACKED
    out = tl.zeros([G, BLOCK_P], tl.int32)
    for i in tl.static_range(PER):
        dims = cols * PER + i
        m = in_res[:, None] & c_mask[None, :]
        x = tl.load(res_src + dims[None, :], mask=m, other=0.0).to(tl.float32)
        x = tl.where(in_res[:, None], x, tl.load(new_src + dims[None, :],
                                                 mask=~in_res[:, None] & c_mask[None, :],
                                                 other=0.0).to(tl.float32))
        lo, hi = tl.min(x, axis=0), tl.max(x, axis=0)
        scale = tl.maximum(tl.math.div_rn(hi - lo, qmax * 1.0), 1e-5).to(tl.float16)
        zero = lo.to(tl.float16)
        tl.store(meta + dims * 2, scale, mask=c_mask)
        tl.store(meta + dims * 2 + 1, zero, mask=c_mask)
        q = _round_half_even(tl.math.div_rn(x - zero.to(tl.float32)[None, :],
                                            scale.to(tl.float32)[None, :]))
        out |= tl.clamp(q, 0.0, qmax * 1.0).to(tl.int32) << (BITS * i)
    tl.store(dst[:, None] + cols[None, :], out.to(tl.uint8), mask=c_mask[None, :])


def rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def store_side(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
               side: PackedSide) -> None:
    """``kv_quant.store`` on the device: ``x`` [T, kv_heads, d] into ``cache``."""
    fmt = side.fmt
    assert cache.is_contiguous() and all(m.is_contiguous() for m in side.meta)
    if fmt.scheme == "kivi" and not side.is_value:
        _store_kivi_k(x, cache, side)
        return
    num_tokens, kv_heads, head_dim = x.shape
    if fmt.scheme == "int4":
        x = kf.rht(x)
    x = rows_contiguous(x)
    scheme = {"int8": SYM8, "int4": ASYM_ZP4, "kivi": KIVI_V}[fmt.scheme]
    _store_per_token_kernel[(num_tokens,)](
        x, cache, side.meta[-1], slots.contiguous(), x.stride(0), x.stride(1),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BITS=fmt.bits, SCHEME=scheme,
        BLOCK_H=max(2, triton.next_power_of_2(kv_heads)),
        BLOCK_P=triton.next_power_of_2(fmt.packed_dim(head_dim)), **_NO_FUSION)


def _store_kivi_k(x: torch.Tensor, cache: torch.Tensor, side: PackedSide) -> None:
    plan, res, fmt = side.plan, side.residual, side.fmt
    x = rows_contiguous(x.to(res.dtype))
    side.recent_k = recent_keys(res, x, plan)  # before the open groups overwrite residual rows
    if plan.group_blocks.numel():
        kv_heads, head_dim = x.shape[1:]
        _store_kivi_k_kernel[(plan.group_blocks.numel(), kv_heads)](
            res, x, cache, side.meta[0], plan.group_blocks, plan.group_index,
            plan.group_sources.contiguous(), res.shape[0],
            res.stride(0), res.stride(1), x.stride(0), x.stride(1),
            KV_HEADS=kv_heads, HEAD_DIM=head_dim, BITS=fmt.bits, PAGE=cache.shape[1],
            G=fmt.group, BLOCK_P=triton.next_power_of_2(fmt.packed_dim(head_dim)),
            **_NO_FUSION)
    if plan.write_tokens.numel():
        res.index_copy_(0, plan.write_rows, x.index_select(0, plan.write_tokens))


def recent_keys(res: torch.Tensor, x: torch.Tensor, plan) -> tuple[torch.Tensor, torch.Tensor]:
    """KIVI: each sequence's full-precision keys from the start of the group its pass begins
    in (``kv_quant.full_precision_k``), packed: (keys [sum, kv_heads, d],
    ``plan.recent_index``). Only what the pass's queries may read in full precision: no copy
    of the residual or the context."""
    rows = torch.cat([r for _, r in plan.recent])
    base = res.shape[0]
    new = x.index_select(0, (rows - base).clamp_(min=0))
    keys = new if base == 0 else torch.where(
        (rows < base)[:, None, None], res.index_select(0, rows.clamp(max=base - 1)), new)
    return keys, plan.recent_index
