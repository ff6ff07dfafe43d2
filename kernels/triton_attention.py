"""Triton paged attention: a flash-attention style prefill and a split-K (flash-decoding) decode.

Both kernels gather K/V token by token through the block table (``slot = table[p // bs] * bs +
p % bs``) in tiles of BLOCK_N positions, so any page size works, including ones below the
16-wide minimum of ``tl.dot``. Scores, softmax and accumulators are float32. ``window`` > 0 (a
sliding-window layer): the query at q sees the keys at q - window < k <= q, and the tiles and
blocks wholly before a query tile's window are not read. ``SOFTCAP`` > 0 (Gemma 2's attention
logit soft-capping, a compile-time constant): each scaled score s becomes tanh(s / C) * C.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvscope.kernels import kv_formats
from kvscope.kernels.kv_quant import PackedSide
from kvscope.kernels.reference import is_fp8
from kvscope.kernels.triton_kv_tiles import (
    INT4,
    KIVI_K,
    kivi_full_scores,
    load_tile,
    meta_of,
    side_format,
)

PREFILL_BLOCK_M = 32
BLOCK_N = 32
DECODE_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 16
DECODE_NUM_WARPS = 4  # triton's default; scripts/gpu_check.py sweeps it with BLOCK_N


def _dot_options(q: torch.Tensor) -> dict:
    # The interpreter computes tl.dot on bfloat16 wrongly, so it gets float32 throughout; on a GPU
    # fp16/bf16 queries use the tensor cores and float32 ones exact ("ieee") products.
    f32 = os.environ.get("TRITON_INTERPRET") == "1" or q.dtype == torch.float32
    return {"DOT_F32": f32, "PRECISION": "ieee" if f32 else None}


@triton.jit
def _attend_tile(q, q_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, k_meta_ptr, v_meta_ptr,
                 full_ptr, full_first, full_row, table_row, offs_n, n_mask, visible,
                 dims, d_mask, kv_head, qk_scale, stride_cb, stride_cs, stride_ch,
                 PAGE: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
                 K_FMT: tl.constexpr, V_FMT: tl.constexpr, BITS: tl.constexpr,
                 KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, G: tl.constexpr):
    """One key/value tile into the running softmax (m_i, l_i, acc) of the query rows `q` (at
    positions `q_pos`); `visible` masks the scores (rows x keys)."""
    k, k_row_scale = load_tile(k_cache_ptr, k_meta_ptr, table_row, offs_n, n_mask, dims, d_mask,
                               kv_head, stride_cb, stride_cs, stride_ch, PAGE, K_FMT, BITS,
                               KV_HEADS, HEAD_DIM, G)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
    if K_FMT == 1 or K_FMT == 2:
        s = s * k_row_scale[None, :]
    if K_FMT == 3:
        s = kivi_full_scores(s, q, q_pos, offs_n, n_mask, full_ptr, full_first, full_row, dims,
                             d_mask, kv_head, qk_scale, PRECISION, KV_HEADS, HEAD_DIM, G)
    if SOFTCAP > 0:  # tanh from exp (no tl.tanh): sign(x) (1 - e^-2|x|) / (1 + e^-2|x|)
        e = tl.exp(-2.0 * tl.abs(s / SOFTCAP))
        s = tl.where(s < 0, -SOFTCAP, SOFTCAP) * (1.0 - e) / (1.0 + e)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row that has seen no visible key yet (a sliding window starting past this tile) keeps
    # m = -inf: subtract 0 there, not -inf (exp(-inf - -inf) is NaN).
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_sub[:, None])
    alpha = tl.exp(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v, v_row_scale = load_tile(v_cache_ptr, v_meta_ptr, table_row, offs_n, n_mask, dims, d_mask,
                               kv_head, stride_cb, stride_cs, stride_ch, PAGE, V_FMT, BITS,
                               KV_HEADS, HEAD_DIM, G)
    if V_FMT == 1 or V_FMT == 2:
        p = p * v_row_scale[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _head_scales(qk_scale, v_scale, k_head_scale_ptr, v_head_scale_ptr, kv_head,
                 HEAD_SCALES: tl.constexpr):
    """fp8_per_head: the KV head's scales times the per-layer ones."""
    if HEAD_SCALES:
        qk_scale = qk_scale * tl.load(k_head_scale_ptr + kv_head)
        v_scale = v_scale * tl.load(v_head_scale_ptr + kv_head)
    return qk_scale, v_scale


@triton.jit
def _full_index(full_index_ptr, seq, K_FMT: tl.constexpr):
    """KIVI: (first position, first row) of the sequence's full-precision keys."""
    if K_FMT == 3:
        return tl.load(full_index_ptr + seq * 2), tl.load(full_index_ptr + seq * 2 + 1)
    return 0, 0


@triton.jit(do_not_specialize=["stride_tb", "window"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, tables_ptr, cu_ptr, ctx_ptr,
    k_meta_ptr, v_meta_ptr, k_head_scale_ptr, v_head_scale_ptr, full_ptr, full_index_ptr,
    qk_scale, v_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_tb,
    stride_cb, stride_cs, stride_ch,
    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, K_FMT: tl.constexpr, V_FMT: tl.constexpr, BITS: tl.constexpr,
    KV_HEADS: tl.constexpr, G: tl.constexpr, HEAD_SCALES: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(ctx_ptr + seq)
    kv_head = head // GROUP
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    q_pos = ctx - q_len + offs_m
    qk_scale, v_scale = _head_scales(qk_scale, v_scale, k_head_scale_ptr, v_head_scale_ptr,
                                     kv_head, HEAD_SCALES)
    full_first, full_row = _full_index(full_index_ptr, seq, K_FMT)
    dims = tl.arange(0, BLOCK_D)
    d_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = tables_ptr + seq * stride_tb
    # Keys after the tile's last query are masked for every row: stop there.
    kv_end = ctx - q_len + tl.minimum((tile + 1) * BLOCK_M, q_len)
    # Keys before the tile's first query's window are masked for every row: start at its tile.
    first_key = tl.where(window > 0, tl.maximum(ctx - q_len + tile * BLOCK_M - window + 1, 0), 0)
    for start in range(first_key // BLOCK_N * BLOCK_N, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        visible = ((offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
                   & ((window == 0) | (offs_n[None, :] > q_pos[:, None] - window)))
        m_i, l_i, acc = _attend_tile(q, q_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr,
                                     k_meta_ptr, v_meta_ptr, full_ptr, full_first, full_row,
                                     table_row, offs_n, n_mask, visible, dims, d_mask, kv_head,
                                     qk_scale, stride_cb, stride_cs, stride_ch, PAGE, PRECISION,
                                     SOFTCAP, K_FMT, V_FMT, BITS, KV_HEADS, HEAD_DIM, G)

    out = acc * (v_scale / l_i)[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


# Lengths that change from step to step are plain arguments, not specialised on, so a running
# engine compiles each kernel once per model rather than again whenever the batch's longest
# context (the table width, the split count) moves: a compile on a GPU stalls a step ~1 s.
_PER_STEP = ["stride_tb", "num_splits", "window"]


@triton.jit(do_not_specialize=_PER_STEP)
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, ctx_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,
    k_meta_ptr, v_meta_ptr, k_head_scale_ptr, full_ptr, full_index_ptr,
    qk_scale, tokens_per_split, num_splits, window,
    stride_qb, stride_qh, stride_tb, stride_cb, stride_cs, stride_ch,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, K_FMT: tl.constexpr, V_FMT: tl.constexpr, BITS: tl.constexpr,
    KV_HEADS: tl.constexpr, G: tl.constexpr, HEAD_SCALES: tl.constexpr,
):
    # One program: all query heads sharing one KV head, over one partition of the context.
    # Grouping lets K/V be loaded once per group and fills tl.dot's 16 rows (padded heads unused).
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(ctx, start + tokens_per_split)
    if window > 0:  # the query is at ctx - 1: the blocks before its window are not read
        start = tl.maximum(start, ctx - window)
    qk_scale, _ = _head_scales(qk_scale, 1.0, k_head_scale_ptr, k_head_scale_ptr, kv_head,
                               HEAD_SCALES)
    full_first, full_row = _full_index(full_index_ptr, seq, K_FMT)
    q_pos = tl.full([BLOCK_H], 0, tl.int32) + ctx - 1
    heads = kv_head * GROUP + tl.arange(0, BLOCK_H)
    h_mask = tl.arange(0, BLOCK_H) < GROUP
    dims = tl.arange(0, BLOCK_D)
    d_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table_row = tables_ptr + seq * stride_tb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        m_i, l_i, acc = _attend_tile(q, q_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr,
                                     k_meta_ptr, v_meta_ptr, full_ptr, full_first, full_row,
                                     table_row, offs_n, n_mask, n_mask[None, :], dims, d_mask,
                                     kv_head, qk_scale, stride_cb, stride_cs, stride_ch, PAGE,
                                     PRECISION, SOFTCAP, K_FMT, V_FMT, BITS, KV_HEADS, HEAD_DIM,
                                     G)

    # An empty partition stores m = -inf, l = 0, acc = 0: weight zero in the reduction.
    part = (seq * NUM_HEADS + heads) * num_splits + split
    tl.store(part_m_ptr + part, m_i, mask=h_mask)
    tl.store(part_l_ptr + part, l_i, mask=h_mask)
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc,
             mask=h_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, v_head_scale_ptr, v_scale, num_splits,
    stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
    HEAD_SCALES: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    _, v_scale = _head_scales(1.0, v_scale, v_head_scale_ptr, v_head_scale_ptr, head // GROUP,
                              HEAD_SCALES)
    splits = tl.arange(0, BLOCK_S)
    s_mask = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    d_mask = dims < HEAD_DIM
    part = (seq * NUM_HEADS + head) * num_splits + splits
    m = tl.load(part_m_ptr + part, mask=s_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)  # noqa: E741
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    # The partition holding the query's own position has a finite max, so the global one is.
    weight = tl.exp(m - tl.max(m, axis=0))
    total = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, (total * v_scale).to(
        out_ptr.dtype.element_ty), mask=d_mask)


def _check(q, k_cache, v_cache, *index_tensors):
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "the KV cache must be contiguous"
    assert k_cache.dtype == v_cache.dtype and k_cache.shape == v_cache.shape
    assert q.shape[1] % k_cache.shape[2] == 0, "num_heads must be a multiple of num_kv_heads"
    # A host tensor here is a wild pointer to the GPU (no error, garbage or a crash).
    for t in (k_cache, *index_tensors):
        assert t.device == q.device, f"a {t.device} tensor passed with {q.device} queries"
    assert all(t.dtype in (torch.int32, torch.int64) for t in index_tensors)
    return q if q.stride(-1) == 1 else q.contiguous()


def _head_block(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


@dataclass
class _Format:
    """What the kernels need of the KV format: the (rotated, for int4 K) queries, the score
    and output scales, the tensors beside the blocks and the compile-time constants."""

    q: torch.Tensor
    qk_scale: float
    v_scale: float
    rotate_out: bool  # int4 V: the output is in the rotated space
    tensors: dict
    consts: dict


def _format_of(q, k_cache, scale, k_scale, v_scale) -> _Format:
    """``k_scale``/``v_scale``: floats (fp8 per layer; ignored for 16/32-bit caches), [kv_heads,
    1] tensors (fp8_per_head) or ``PackedSide``s."""
    k_fmt, v_fmt = side_format(k_scale, False), side_format(v_scale, True)
    fmt = next((s.fmt for s in (k_scale, v_scale) if isinstance(s, PackedSide)), None)
    head_scales = isinstance(k_scale, torch.Tensor)
    qk, vs = float(scale), 1.0
    if is_fp8(k_cache.dtype) and not head_scales:
        qk, vs = qk * float(k_scale), float(v_scale)
    if k_fmt == INT4:  # (H D q) . (H D k) = b q . k for H of order b
        rotation = q.shape[-1] & -q.shape[-1]
        q, qk = kv_formats.rht(q).to(q.dtype), qk / rotation
    full, full_index = None, None
    if k_fmt == KIVI_K:
        assert k_scale.recent_k is not None, "KIVI K: the pass's triton store sets recent_k"
        full, full_index = k_scale.recent_k
    tensors = dict(k_meta_ptr=meta_of(k_scale, False), v_meta_ptr=meta_of(v_scale, True),
                   k_head_scale_ptr=k_scale.reshape(-1) if head_scales else None,
                   v_head_scale_ptr=v_scale.reshape(-1) if head_scales else None,
                   full_ptr=full, full_index_ptr=full_index)
    consts = dict(K_FMT=k_fmt, V_FMT=v_fmt, BITS=fmt.bits if fmt else 8,
                  G=fmt.group if fmt and fmt.group else 1, KV_HEADS=k_cache.shape[2],
                  HEAD_SCALES=head_scales)
    return _Format(q, qk, vs, v_fmt == INT4, tensors, consts)


def _output(out: torch.Tensor, f: _Format, dtype: torch.dtype) -> torch.Tensor:
    if not f.rotate_out:
        return out
    return kv_formats.rht(out, inverse=True).to(dtype)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                            k_scale, v_scale, max_seqlen_q: int, window=None,
                            softcap=None) -> torch.Tensor:
    """``max_seqlen_q``: the longest query length, a host int (sizes the grid)."""
    q = _check(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens)
    batch = context_lens.shape[0]
    if q.shape[0] == 0 or batch == 0:
        return torch.empty_like(q)
    f = _format_of(q, k_cache, scale, k_scale, v_scale)
    out = torch.empty(q.shape, dtype=torch.float32 if f.rotate_out else q.dtype, device=q.device)
    num_heads, head_dim = q.shape[1], q.shape[2]
    grid = (batch, num_heads, triton.cdiv(max_seqlen_q, PREFILL_BLOCK_M))
    _prefill_kernel[grid](
        f.q, k_cache, v_cache, out, block_tables, cu_seqlens_q, context_lens, **f.tensors,
        qk_scale=f.qk_scale, v_scale=f.v_scale, window=window or 0,
        stride_qt=f.q.stride(0), stride_qh=f.q.stride(1), stride_ot=out.stride(0),
        stride_oh=out.stride(1), stride_tb=block_tables.stride(0),
        stride_cb=k_cache.stride(0), stride_cs=k_cache.stride(1), stride_ch=k_cache.stride(2),
        GROUP=num_heads // k_cache.shape[2], PAGE=k_cache.shape[1], HEAD_DIM=head_dim,
        BLOCK_D=_head_block(head_dim), BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=BLOCK_N, **_dot_options(q),
        SOFTCAP=float(softcap or 0.0), **f.consts,
    )
    return _output(out, f, q.dtype)


def choose_num_splits(max_context: int, batch: int, num_kv_heads: int) -> int:
    """Enough partitions to keep long contexts parallel, fewer when the batch fills the GPU."""
    by_length = triton.cdiv(max_context, DECODE_TOKENS_PER_SPLIT)
    by_occupancy = max(1, 256 // max(1, batch * num_kv_heads))
    return max(1, min(MAX_SPLITS, by_length, by_occupancy))


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                           k_scale, v_scale, max_seqlen_k: int, num_splits=None,
                           window=None, softcap=None) -> torch.Tensor:
    """``max_seqlen_k``: the longest context, a host int (sizes the split-K partitions)."""
    q = _check(q, k_cache, v_cache, block_tables, context_lens)
    batch, num_heads, head_dim = q.shape
    if batch == 0:
        return torch.empty_like(q)
    f = _format_of(q, k_cache, scale, k_scale, v_scale)
    out = torch.empty(q.shape, dtype=torch.float32 if f.rotate_out else q.dtype, device=q.device)
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    if num_splits is None:
        num_splits = choose_num_splits(max_seqlen_k, batch, num_kv_heads)
    tokens_per_split = triton.cdiv(triton.cdiv(max_seqlen_k, num_splits), BLOCK_N) * BLOCK_N
    part_m = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32,
                           device=q.device)
    group = num_heads // num_kv_heads
    block_d = _head_block(head_dim)
    v_head_scale = f.tensors.pop("v_head_scale_ptr")
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        f.q, k_cache, v_cache, block_tables, context_lens, part_m, part_l, part_acc,
        **f.tensors, qk_scale=f.qk_scale, tokens_per_split=tokens_per_split,
        num_splits=num_splits, window=window or 0,
        stride_qb=f.q.stride(0), stride_qh=f.q.stride(1), stride_tb=block_tables.stride(0),
        stride_cb=k_cache.stride(0), stride_cs=k_cache.stride(1), stride_ch=k_cache.stride(2),
        NUM_HEADS=num_heads, GROUP=group, PAGE=page, HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=BLOCK_N,
        num_warps=DECODE_NUM_WARPS, SOFTCAP=float(softcap or 0.0), **_dot_options(q),
        **f.consts,
    )
    _decode_reduce_kernel[(batch, num_heads)](
        part_m, part_l, part_acc, out, v_head_scale, f.v_scale, num_splits, out.stride(0),
        out.stride(1), NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_S=max(MAX_SPLITS, triton.next_power_of_2(num_splits)), BLOCK_D=block_d,
        GROUP=group, HEAD_SCALES=f.consts["HEAD_SCALES"],
    )
    return _output(out, f, q.dtype)
