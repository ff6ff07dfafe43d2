"""Builds paged KV caches from dense per-sequence K/V, independently of the kernels under test."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if dtype == FP8:
        return (x.float() / scale).clamp(-448, 448).to(FP8)
    return x.to(dtype)


def from_cache(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x.float() * scale if x.dtype == FP8 else x.float()


def build_paged(lengths, num_kv_heads, head_dim, block_size, dtype, *, k_scale=1.0, v_scale=1.0,
                seed=0, spare_blocks=3):
    """Random dense K/V per sequence written into a paged cache with shuffled block tables.

    Returns (k_cache, v_cache, block_tables int32, dense) where dense[b] = (k, v) as float32
    tensors [len, kv_heads, head_dim] holding exactly the values the cache represents.
    """
    gen = torch.Generator().manual_seed(seed)
    need = [(n + block_size - 1) // block_size for n in lengths]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(need) + 1  # one extra padded (0) column, like a real runner's table
    tables = torch.zeros(len(lengths), max_blocks, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Garbage everywhere first, so that reading a wrong slot shows up.
    k_cache = to_cache(torch.randn(shape, generator=gen) * 3, dtype, k_scale)
    v_cache = to_cache(torch.randn(shape, generator=gen) * 3, dtype, v_scale)
    dense = []
    for b, n in enumerate(lengths):
        blocks = [perm.pop() for _ in range(need[b])]
        tables[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        kv_shape = (n, num_kv_heads, head_dim)
        k = to_cache(torch.randn(kv_shape, generator=gen) * k_scale, dtype, k_scale)
        v = to_cache(torch.randn(kv_shape, generator=gen) * v_scale, dtype, v_scale)
        for p in range(n):
            k_cache[blocks[p // block_size], p % block_size] = k[p]
            v_cache[blocks[p // block_size], p % block_size] = v[p]
        dense.append((from_cache(k, k_scale), from_cache(v, v_scale)))
    return k_cache, v_cache, tables, dense


def dense_causal_attention(q, k, v, scale, window=None, softcap=None):
    """q [M, H, D] at the last M positions of k/v [N, Hkv, D]; float32 SDPA on unpaged tensors;
    `window` W: each query also sees only the W newest keys up to its own position; `softcap` C:
    the scores soft-capped as transformers' Gemma 2 does (tanh(s / C) * C before the mask)."""
    m, n = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    q_pos = torch.arange(n - m, n)[:, None]
    allowed = torch.arange(n)[None, :] <= q_pos
    if window is not None:
        allowed &= torch.arange(n)[None, :] > q_pos - window
    q, k, v = q.float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if softcap is not None:
        scores = torch.tanh(q @ k.transpose(1, 2) * scale / softcap) * softcap
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        return (probs @ v).transpose(0, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    return out.transpose(0, 1)
