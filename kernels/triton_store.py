"""Triton kernel writing new K/V tokens into their paged cache slots (casting or fp8-quantising,
with a scale per layer or per layer and KV head); the formats with scales beside the block are
triton_store_packed's."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscope.kernels.kv_quant import PackedSide
from kvscope.kernels.reference import FP8_MAX, is_fp8
from kvscope.kernels.triton_store_packed import rows_contiguous, store_side


@triton.jit
def _round_to_e4m3(x):
    # Round-to-nearest-even onto the e4m3 grid in float32 (|x| <= 448), so that the cast is exact
    # whatever rounding the conversion does: the triton interpreter's fp8 cast drops the carry
    # into the exponent (7.9 -> 4.0). Integer and add-only arithmetic: safe from FMA contraction.
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1  # keep 3 of float32's 23 mantissa bits
    normal = ((bits + 0x7FFFF + lsb) & -0x100000).to(tl.float32, bitcast=True)
    subnormal = (x + 24576.0) - 24576.0  # 1.5 * 2^14 has an ulp of 2^-9, the e4m3 subnormal step
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_FP8: tl.constexpr, FP8_LIMIT: tl.constexpr, HEAD_SCALES: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM) & (slot >= 0)
    # The cache is contiguous: one slot holds NUM_KV_HEADS * HEAD_DIM values.
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]

    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :],
                mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :],
                mask=mask)
    if HEAD_SCALES:  # fp8_per_head: pointers to [NUM_KV_HEADS] scales
        h_mask = heads < NUM_KV_HEADS
        k_scale = tl.load(k_scale + heads, mask=h_mask, other=1.0)[:, None]
        v_scale = tl.load(v_scale + heads, mask=h_mask, other=1.0)[:, None]
    if IS_FP8:
        k = _round_to_e4m3(tl.clamp(k.to(tl.float32) / k_scale, -FP8_LIMIT, FP8_LIMIT))
        v = _round_to_e4m3(tl.clamp(v.to(tl.float32) / v_scale, -FP8_LIMIT, FP8_LIMIT))
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "the KV cache must be contiguous"
    if isinstance(k_scale, PackedSide):
        store_side(key, k_cache, slot_mapping, k_scale)
        store_side(value, v_cache, slot_mapping, v_scale)
        return
    assert k_cache.dtype == v_cache.dtype
    assert k_cache.device == slot_mapping.device == key.device, "tensors on different devices"
    key, value = rows_contiguous(key), rows_contiguous(value)
    head_scales = isinstance(k_scale, torch.Tensor)
    if head_scales:
        k_scale, v_scale = k_scale.reshape(-1).float(), v_scale.reshape(-1).float()
    else:
        k_scale, v_scale = float(k_scale), float(v_scale)
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping.contiguous(),
        k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=max(2, triton.next_power_of_2(num_kv_heads)),
        BLOCK_D=triton.next_power_of_2(head_dim),
        IS_FP8=is_fp8(k_cache.dtype), FP8_LIMIT=FP8_MAX, HEAD_SCALES=head_scales,
    )
