"""Public kernel functions: triton on CUDA tensors, the torch reference elsewhere.

``impl="torch" | "triton"`` forces one implementation (tests run triton on the CPU with
``TRITON_INTERPRET=1``). The triton modules are imported lazily so that the variable set by the
caller before the first triton call is honoured, and so that CPU users never import triton.
"""

from __future__ import annotations

import torch

from kvscope.kernels import reference

_CACHE_DTYPES = {
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "float8_e4m3": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


def kv_cache_dtype_of(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """Map an ``EngineConfig.kv_cache_dtype`` name to the cache tensor dtype."""
    key = name.lower()
    if key == "auto":
        return model_dtype
    if key not in _CACHE_DTYPES:
        accepted = ", ".join(["auto", *_CACHE_DTYPES])
        raise ValueError(f"unknown kv_cache_dtype {name!r}; accepted: {accepted}")
    return _CACHE_DTYPES[key]


def _use_triton(impl: str | None, tensor: torch.Tensor) -> bool:
    if impl is None:
        return tensor.is_cuda
    if impl not in ("torch", "triton"):
        raise ValueError(f"impl must be 'torch', 'triton' or None, not {impl!r}")
    return impl == "triton"


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0,
             impl=None) -> None:
    """Write ``key``/``value`` ``[num_tokens, kv_heads, head_dim]`` into the cache slots;
    slot -1 is skipped."""
    if _use_triton(impl, key):
        from kvscope.kernels import triton_store

        triton_store.store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                            k_scale=1.0, v_scale=1.0, impl=None, max_seqlen_q=None) -> torch.Tensor:
    """Causal attention of packed new tokens over the paged KV (cached prefix plus themselves).

    ``max_seqlen_q`` (optional, the longest query length) spares the triton path a device read.
    """
    if _use_triton(impl, q):
        from kvscope.kernels import triton_attention

        return triton_attention.paged_prefill_attention(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, k_scale, v_scale,
            max_seqlen_q)
    return reference.paged_prefill_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, k_scale, v_scale)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                           k_scale=1.0, v_scale=1.0, num_splits=None, impl=None) -> torch.Tensor:
    """One query per sequence at position ``context_lens[b] - 1`` over the paged KV."""
    if _use_triton(impl, q):
        from kvscope.kernels import triton_attention

        return triton_attention.paged_decode_attention(
            q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale, num_splits)
    return reference.paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, pairs) -> None:
    """Copy whole blocks ``src -> dst`` for each ``(src, dst)`` in ``pairs`` (copy-on-write)."""
    if not pairs:
        return
    src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=k_cache.device)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=k_cache.device)
    k_cache[dst] = k_cache[src]
    v_cache[dst] = v_cache[src]
