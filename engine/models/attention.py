"""Attention over the paged KV cache (or, for the no-cache baseline, plain causal attention).

One ``AttentionContext`` describes a whole packed forward pass; every layer reads it and picks
its own slice of the KV tensor (``cache_index``) and its KV-cache group's block tables
(``group``: kvscope.engine.kv_groups), both set by the model runner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvscope.kernels import KernelBackend, reference


@dataclass
class AttentionContext:
    """Per-forward metadata, built by the model runner.

    ``kv_cache is None`` selects the naive path: each sequence attends causally over its own
    packed tokens only (positions 0..n-1), nothing is stored.
    """

    seq_lens_q: list[int]                    # new tokens per sequence, in packing order
    # Host-side maxima, computed where the batch is built: no layer reads a length back from
    # the device (a read would stall the host on the GPU once per layer).
    max_seqlen_q: int = 0                    # max(seq_lens_q)
    max_seqlen_k: int = 0                    # max(context_lens)
    cu_seqlens_q: torch.Tensor | None = None  # int32 [B+1]
    kv_cache: torch.Tensor | None = None     # [layers, 2, num_blocks, block_size, kv_heads, d]
    slot_mapping: torch.Tensor | None = None  # int64 [T]
    block_tables: torch.Tensor | None = None  # int32 [B, max_blocks], padded with 0
    # KV-cache groups 1.. (group 0's are the two above): (block_tables, slot_mapping) each
    more_groups: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    context_lens: torch.Tensor | None = None  # int32 [B], including the new tokens
    is_decode: bool = False                  # every sequence has exactly one new token
    k_scales: list[float] | None = None      # per layer, fp8 caches only
    v_scales: list[float] | None = None
    # if a list: layers append [|k|max, |v|max] per KV head, [2, kv_heads]
    kv_amax: list[torch.Tensor] | None = None
    kernels: KernelBackend | None = None     # chosen once by the model runner
    # Formats with scales beside the block: (cache_index, group) -> the (K, V) PackedSide a
    # layer passes in place of its scales
    kv_sides: Callable[[int, int], tuple] | None = None
    # A lab measurement (lab/experiments/kv_sides.py): side 0 (K) or 1 (V) kept in the model's
    # dtype in this tensor [slices, num_blocks, block_size, kv_heads, d], the other in the format
    kv_kept: tuple[int, torch.Tensor] | None = None


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 window: int | None = None, scale: float | None = None,
                 softcap: float | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.cache_index = layer_idx  # this layer's slice of the KV tensor
        self.group = 0  # its KV-cache group: whose block tables it reads and writes
        self.window = window  # a sliding-window layer's W: keys at q - W < k <= q; None: all
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.softcap = softcap  # scores -> tanh(s / C) * C before the mask (Gemma 2); None: none

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        """q ``[T, heads, d]``, k/v ``[T, kv_heads, d]`` (rotary applied) -> ``[T, heads, d]``."""
        if ctx.kv_amax is not None:
            ctx.kv_amax.append(torch.stack((k.abs().amax((0, 2)), v.abs().amax((0, 2)))))
        if ctx.kv_cache is None:
            return self._naive(q, k, v, ctx.seq_lens_q)

        k_cache, v_cache = ctx.kv_cache[self.cache_index]
        if ctx.kv_sides is not None:
            k_scale, v_scale = ctx.kv_sides(self.cache_index, self.group)
        else:
            k_scale = ctx.k_scales[self.layer_idx] if ctx.k_scales else 1.0
            v_scale = ctx.v_scales[self.layer_idx] if ctx.v_scales else 1.0
        if ctx.kv_kept is not None:
            side, kept = ctx.kv_kept
            if side:
                v_cache, v_scale = kept[self.cache_index], 1.0
            else:
                k_cache, k_scale = kept[self.cache_index], 1.0
        kernels = ctx.kernels
        tables, slots = ctx.block_tables, ctx.slot_mapping
        if self.group:
            tables, slots = ctx.more_groups[self.group - 1]
        kernels.store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
        if ctx.is_decode:
            return kernels.paged_decode_attention(
                q, k_cache, v_cache, tables, ctx.context_lens, self.scale,
                k_scale, v_scale, ctx.max_seqlen_k, window=self.window, softcap=self.softcap)
        return kernels.paged_prefill_attention(
            q, k_cache, v_cache, tables, ctx.cu_seqlens_q, ctx.context_lens,
            self.scale, k_scale, v_scale, ctx.max_seqlen_q, window=self.window,
            softcap=self.softcap)

    def _naive(self, q, k, v, seq_lens: list[int]) -> torch.Tensor:
        outs = []
        for qs, ks, vs in zip(q.split(seq_lens), k.split(seq_lens), v.split(seq_lens),
                              strict=True):
            n = qs.shape[0]
            if self.softcap or (self.window is not None and self.window < n):
                pos = torch.arange(n, device=qs.device)
                mask = pos[None, :] <= pos[:, None]
                if self.window is not None:
                    mask &= pos[None, :] > pos[:, None] - self.window
                o = reference.attention(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                        vs.transpose(0, 1)[None], mask, self.scale,
                                        self.softcap)[0]
            else:
                o = F.scaled_dot_product_attention(
                    qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                    is_causal=True, scale=self.scale, enable_gqa=True)
            outs.append(o.transpose(0, 1))
        return torch.cat(outs)
