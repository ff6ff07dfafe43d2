"""Torch reference kernels: the CPU implementation and the oracle for the triton kernels.

Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]``. Position ``p`` of a sequence
lives in slot ``block_table[p // block_size] * block_size + p % block_size``. ``window`` W (a
sliding-window layer; None: full attention): the query at position q sees the keys at
q - W < k <= q, as transformers' sliding-window mask. ``softcap`` C (Gemma 2's attention logit
soft-capping; None: none): each scaled score s becomes ``tanh(s / C) * C`` before the mask and
softmax. For an fp8 cache the
stored value is ``x / scale`` (saturated to the e4m3 range) and the read value ``stored * scale``;
the scale is a float (per layer) or a ``[kv_heads, 1]`` tensor (per layer and head). Formats
with scales beside the block get a ``kv_quant.PackedSide`` in place of a scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvscope.kernels import kv_quant
from kvscope.kernels.kv_quant import PackedSide

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0

# Bounds the float32 score matrix of one prefill chunk (query rows x heads x keys).
_MAX_SCORE_ELEMENTS = 1 << 25


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def quantize(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Convert model-dtype values to what the cache stores."""
    if is_fp8(cache_dtype):
        return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(cache_dtype)
    return x.to(cache_dtype)


def dequantize(stored: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache values as float32, with the fp8 scale applied."""
    if is_fp8(stored.dtype):
        return stored.float() * scale
    return stored.float()


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    keep = None
    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        if isinstance(scale, PackedSide):
            kv_quant.store(x, cache, slot_mapping, scale)
            continue
        if keep is None:
            keep = (slot_mapping >= 0).nonzero().squeeze(1)
            slots = slot_mapping if keep.numel() == slot_mapping.numel() else slot_mapping[keep]
        if keep.numel() == 0:
            continue
        if keep.numel() != x.shape[0]:
            x = x.index_select(0, keep)
        values = quantize(x, cache.dtype, scale)
        flat = cache.view(-1, cache.shape[2], cache.shape[3])
        # index_copy_ is far faster than index_put on the CPU but has no fp8 kernel: copy bytes.
        if is_fp8(cache.dtype):
            flat, values = flat.view(torch.uint8), values.view(torch.uint8)
        flat.index_copy_(0, slots.long(), values)


def gather_kv(cache, block_table, length, scale, seq: int = 0) -> torch.Tensor:
    """First ``length`` positions of sequence ``seq`` (its ``block_table``), float32
    ``[length, kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    if isinstance(scale, PackedSide):
        values = kv_quant.read_blocks(cache, block_table[:num_blocks].long(), scale)
        values = values.view(-1, *values.shape[2:])[:length]
        kv_quant.overlay_residual(values, scale, seq)
        return values
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return dequantize(blocks.reshape(-1, cache.shape[2], cache.shape[3])[:length], scale)


def _attend(q, k, v, q_pos, k_pos, scale, window=None, softcap=None, full=None
            ) -> torch.Tensor:
    """q: [M, H, D] float32; k, v: [N, Hkv, D] float32; causal on positions (and within the
    window). ``full``: KIVI's (g, K from position g on, group size): a query reads the keys of
    its own group there unless it completes the group. Returns [M, H, D]."""
    m, num_heads, head_dim = q.shape
    n, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    # Batched over KV heads, with each head's query group stacked as rows.
    qg = q.reshape(m, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    qg = qg.reshape(num_kv_heads, group * m, head_dim)
    scores = torch.bmm(qg, k.permute(1, 2, 0)).view(num_kv_heads, group, m, n).mul_(scale)
    if full is not None:
        first, k_full, g = full
        k_full = k_full[:n - first].float()  # the model dtype's (the residual, new keys)
        own = torch.bmm(qg, k_full.permute(1, 2, 0)).view(num_kv_heads, group, m, -1).mul_(scale)
        same = (k_pos[None, first:n] // g == q_pos[:, None] // g) & ((q_pos[:, None] + 1) % g != 0)
        scores[..., first:n] = torch.where(same, own, scores[..., first:n])
    if softcap:
        scores.div_(softcap).tanh_().mul_(softcap)
    hidden = k_pos[None, :] > q_pos[:, None]
    if window is not None:
        hidden |= k_pos[None, :] <= q_pos[:, None] - window
    scores.masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(num_kv_heads, group * m, n)
    out = torch.bmm(probs, v.transpose(0, 1)).view(num_kv_heads, group, m, head_dim)
    return out.permute(2, 0, 1, 3).reshape(m, num_heads, head_dim)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                            k_scale=1.0, v_scale=1.0, max_seqlen_q=None,
                            window=None, softcap=None) -> torch.Tensor:
    """``max_seqlen_q`` is unused: this CPU kernel walks the lengths on the host anyway."""
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    ctx_lens = context_lens.tolist()
    num_heads = q.shape[1]
    for b, ctx in enumerate(ctx_lens):
        start, end = cu[b], cu[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[b], ctx, k_scale, b)
        v = gather_kv(v_cache, block_tables[b], ctx, v_scale, b)
        k_pos = torch.arange(ctx, device=q.device)
        full = kv_quant.full_precision_k(k_scale, b) if isinstance(k_scale, PackedSide) else None
        if full is not None:
            full = (*full, k_scale.fmt.group)
        rows = max(1, _MAX_SCORE_ELEMENTS // (num_heads * ctx))
        for i in range(0, q_len, rows):
            j = min(q_len, i + rows)
            q_pos = torch.arange(ctx - q_len + i, ctx - q_len + j, device=q.device)
            # Keys past the chunk's last query are fully masked: skip them.
            n = ctx - q_len + j
            o = _attend(q[start + i:start + j].float(), k[:n], v[:n], q_pos, k_pos[:n], scale,
                        window, softcap, full)
            out[start + i:start + j] = o.to(q.dtype)
    return out


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                           k_scale, v_scale, max_seqlen_k, num_splits=None,
                           window=None, softcap=None) -> torch.Tensor:
    """Vectorised over the batch: gathers every sequence to the longest context
    (``max_seqlen_k``, from the host) and masks. ``num_splits`` is the triton kernel's: unused.

    The gathered ``[batch, kv_heads, keys, head_dim]`` views go to torch's fused attention as
    they are (GQA without repeating heads, no transposed copies): ~30 % less time on the CPU
    than explicit score and softmax tensors."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_ctx = max_seqlen_k
    num_blocks = (max_ctx + block_size - 1) // block_size
    table = block_tables[:, :num_blocks].long()

    def gather(cache, s):  # index_select: several times faster than cache[table] on the CPU
        if isinstance(s, PackedSide):
            values = kv_quant.read_blocks(cache, table.reshape(-1), s)
            values = values.view(batch, -1, num_kv_heads, head_dim)
            kv_quant.overlay_residual(values, s)
            return values.transpose(1, 2)
        blocks = cache.index_select(0, table.reshape(-1))
        return dequantize(blocks.view(batch, -1, num_kv_heads, head_dim), s).transpose(1, 2)

    k, v = gather(k_cache, k_scale), gather(v_cache, v_scale)
    keys, lens = torch.arange(k.shape[2], device=q.device), context_lens.to(q.device).long()
    mask = keys < lens[:, None]
    if window is not None:  # the query is at position len - 1
        mask &= keys >= (lens - window)[:, None]
    out = attention(q.float().unsqueeze(2), k, v, mask[:, None, None, :], scale, softcap)
    return out.squeeze(2).to(q.dtype)


def attention(q, k, v, mask, scale, softcap=None) -> torch.Tensor:
    """torch's fused attention of q ``[B, H, M, D]`` over k/v ``[B, Hkv, N, D]`` (GQA without
    repeated heads) with a boolean ``mask`` (True: seen) broadcast to ``[B, H, M, N]``; with a
    ``softcap``, explicit scores instead (the fused kernel has no soft-capping)."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)).mul_(scale).div_(softcap).tanh_().mul_(softcap)
    scores.masked_fill_(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v
