"""Triton helpers of the paged attention kernels: one tile of K or V read from the paged cache in
its stored format, dequantized in registers (no dequantized copy of the context anywhere), and
KIVI's full-precision keys.

``FMT`` (per side, a compile-time constant) says how a tile is read:

- ``PLAIN``: the stored values (16/32-bit, or fp8 whose per-layer or per-head scale the kernel
  folds into the score scale and the output);
- ``INT8`` / ``INT4``: integer values (int4: ``code - zero point``, in the Hadamard-rotated
  space; the wrapper rotates the queries and rotates the output back, as vLLM) and a scale per
  key, which the kernel applies to the scores (K) or the softmax weights (V), as vLLM: the
  integer tile is exact in the query dtype;
- ``KIVI_K`` / ``KIVI_V``: ``code * scale + zero`` in float32 (K per channel over its group,
  V per token).

Sub-byte codes: element ``i`` of a byte at bits ``BITS * i`` (kv_formats.pack).
"""

from __future__ import annotations

import triton
import triton.language as tl

PLAIN, INT8, INT4, KIVI_K, KIVI_V = 0, 1, 2, 3, 4


def side_format(side, is_value: bool) -> int:
    """The ``FMT`` of a side: ``side`` a ``kv_quant.PackedSide`` or a plain/fp8 scale."""
    scheme = getattr(getattr(side, "fmt", None), "scheme", None)
    if scheme == "kivi":
        return KIVI_V if is_value else KIVI_K
    return {"int8": INT8, "int4": INT4}.get(scheme, PLAIN)


@triton.jit
def load_tile(cache_ptr, meta_ptr, table_row, offs_n, n_mask, dims, d_mask, kv_head,
              stride_b, stride_s, stride_h, PAGE: tl.constexpr, FMT: tl.constexpr,
              BITS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
              G: tl.constexpr):
    """Keys or values at positions ``offs_n`` [N] of one KV head: (tile [N, BLOCK_D], a scale
    per position [N] for INT8/INT4, else 1.0)."""
    blocks = tl.load(table_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
    in_page = offs_n % PAGE
    rows = blocks * stride_b + in_page * stride_s + kv_head * stride_h
    mask = n_mask[:, None] & d_mask[None, :]
    if FMT == 0:
        return tl.load(cache_ptr + rows[:, None] + dims[None, :], mask=mask, other=0.0), 1.0
    PER: tl.constexpr = 8 // BITS
    raw = tl.load(cache_ptr + rows[:, None] + (dims // PER)[None, :], mask=mask, other=0)
    if PER == 1:
        codes = raw.to(tl.float32)
    else:
        codes = ((raw.to(tl.int32) >> (BITS * (dims % PER))[None, :]) & ((1 << BITS) - 1)
                 ).to(tl.float32)
    token = (blocks * PAGE + in_page) * KV_HEADS + kv_head  # meta row of (position, head)
    if FMT == 1:
        return codes, tl.load(meta_ptr + token, mask=n_mask, other=0.0)
    if FMT == 2:
        bits = tl.load(meta_ptr + token, mask=n_mask, other=0.0).to(tl.int32, bitcast=True)
        zero = (bits & 15).to(tl.float32)
        return codes - zero[:, None], (bits & -16).to(tl.float32, bitcast=True)
    if FMT == 3:
        group = ((blocks * (PAGE // G) + in_page // G) * KV_HEADS + kv_head) * HEAD_DIM
        at = (group[:, None] + dims[None, :]) * 2
        scale = tl.load(meta_ptr + at, mask=mask, other=0.0).to(tl.float32)
        zero = tl.load(meta_ptr + at + 1, mask=mask, other=0.0).to(tl.float32)
        return codes * scale + zero, 1.0
    scale = tl.load(meta_ptr + token * 2, mask=n_mask, other=0.0).to(tl.float32)
    zero = tl.load(meta_ptr + token * 2 + 1, mask=n_mask, other=0.0).to(tl.float32)
    return codes * scale[:, None] + zero[:, None], 1.0


@triton.jit
def kivi_full_scores(s, q, q_pos, offs_n, n_mask, full_ptr, full_first, full_row, dims, d_mask,
                     kv_head, qk_scale, PRECISION: tl.constexpr, KV_HEADS: tl.constexpr,
                     HEAD_DIM: tl.constexpr, G: tl.constexpr):
    """KIVI (kv_quant.full_precision_k): a query at q reads the keys of its own group in full
    precision unless q completes the group; ``full_ptr`` holds the sequence's keys from
    position ``full_first`` on, at row ``full_row``."""
    if tl.max(offs_n, axis=0) >= full_first:
        recent = (offs_n >= full_first) & n_mask
        rows = (full_row + tl.where(recent, offs_n - full_first, 0)).to(tl.int64)
        k = tl.load(full_ptr + (rows * KV_HEADS + kv_head)[:, None] * HEAD_DIM + dims[None, :],
                    mask=recent[:, None] & d_mask[None, :], other=0.0)
        own = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
        same = (recent[None, :] & (offs_n[None, :] // G == q_pos[:, None] // G)
                & ((q_pos[:, None] + 1) % G != 0))
        s = tl.where(same, own, s)
    return s


def meta_of(side, is_value: bool):
    """The tensor beside the blocks a side's kernel reads (None for plain and fp8)."""
    meta = getattr(side, "meta", None)
    if not meta:
        return None
    return meta[-1] if is_value else meta[0]

