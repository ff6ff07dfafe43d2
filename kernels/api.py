"""Public kernel functions: triton on CUDA tensors, the torch reference elsewhere.

The engine picks a ``KernelBackend`` once (``kernel_backend``, when the model runner is built)
and calls it directly with host-side maximum lengths, so no launch reads a length back from the
device. The module-level functions below are for tests and one-off calls: they choose the
backend per call (``impl="torch" | "triton"`` forces one; tests run triton on the CPU with
``TRITON_INTERPRET=1``) and compute a missing maximum from the tensors. The triton modules are
imported lazily so that the variable set by the caller before the first triton call is honoured,
and so that CPU users never import triton.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvscope.kernels import cpu, cpu_formats, reference
from kvscope.kernels.kv_quant import PackedSide

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


@dataclass(frozen=True)
class KernelBackend:
    """One implementation of the three kernels, with the same signatures:

    ``store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)``,
    ``paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
    scale, k_scale, v_scale, max_seqlen_q, window=None, softcap=None)`` and
    ``paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale,
    v_scale, max_seqlen_k, num_splits=None, window=None, softcap=None)``; ``window``: a
    sliding-window layer's W (the query at q sees the keys at q - W < k <= q), None: full
    attention; ``softcap`` C: each scaled score s becomes tanh(s / C) * C (Gemma 2), None: none.
    """

    name: str  # "cpu" | "torch" | "triton"
    store_kv: Callable[..., None]
    paged_prefill_attention: Callable[..., torch.Tensor]
    paged_decode_attention: Callable[..., torch.Tensor]


def kernel_backend(impl: str | None, device: str | torch.device) -> KernelBackend:
    """``impl`` None: triton on CUDA, "cpu" elsewhere; "cpu", "torch" or "triton" force one.

    "cpu" is the torch reference with C kernels (``cpu.py``): the store for float32 caches,
    decode attention for every format (``cpu_formats.py``: packed formats read in place), a
    float32 query given; anything else falls back to torch. Prefill attention runs on torch's
    fused attention (``cpu.prefill_attention``)."""
    if impl is None:
        impl = "triton" if torch.device(device).type == "cuda" else "cpu"
    if impl == "cpu":
        return KernelBackend("cpu", _cpu_store_kv, _cpu_prefill_attention,
                             _cpu_paged_decode_attention)
    if impl == "torch":
        return KernelBackend("torch", reference.store_kv, reference.paged_prefill_attention,
                             reference.paged_decode_attention)
    if impl == "triton":
        from kvscope.kernels import triton_attention, triton_store

        return KernelBackend("triton", triton_store.store_kv,
                             triton_attention.paged_prefill_attention,
                             triton_attention.paged_decode_attention)
    raise ValueError(f"impl must be 'cpu', 'torch', 'triton' or None, not {impl!r}")


def _cpu_store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    if not cpu.store_kv(key, value, k_cache, v_cache, slot_mapping):
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def _cpu_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                           k_scale=1.0, v_scale=1.0, max_seqlen_q=None, window=None,
                           softcap=None) -> torch.Tensor:
    """KIVI's prefill reads some keys in full precision per query: the reference's scores."""
    fused = not (isinstance(k_scale, PackedSide) and k_scale.fmt.scheme == "kivi")
    return (cpu.prefill_attention if fused else reference.paged_prefill_attention)(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, k_scale, v_scale,
        max_seqlen_q, window=window, softcap=softcap)


def _cpu_paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                k_scale, v_scale, max_seqlen_k, num_splits=None,
                                window=None, softcap=None) -> torch.Tensor:
    out = cpu_formats.decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                       k_scale, v_scale, max_seqlen_k, window, softcap)
    if out is None:
        out = reference.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                               scale, k_scale, v_scale, max_seqlen_k, num_splits,
                                               window, softcap)
    return out


def check_fp8_support(device: str | torch.device) -> None:
    """Triton loads and casts float8 e4m3 only on compute capability 8.9+ (Ada, Hopper): say so
    when the cache is made, not with a compiler error at the first step."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(f"an fp8 KV cache needs a GPU of compute capability 8.9 or newer for "
                         f"the triton kernels (this one is {major}.{minor}); use float16 or "
                         f"bfloat16")


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0,
             impl=None) -> None:
    """Write ``key``/``value`` ``[num_tokens, kv_heads, head_dim]`` into the cache slots;
    slot -1 is skipped."""
    kernel_backend(impl, key.device).store_kv(key, value, k_cache, v_cache, slot_mapping,
                                              k_scale, v_scale)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                            k_scale=1.0, v_scale=1.0, impl=None, max_seqlen_q=None,
                            window=None, softcap=None) -> torch.Tensor:
    """Causal attention of packed new tokens over the paged KV (cached prefix plus themselves),
    within a sliding ``window`` when one is given, scores soft-capped by ``softcap``.

    ``max_seqlen_q`` (the longest query length) is read from ``cu_seqlens_q`` when not given.
    """
    if max_seqlen_q is None:
        max_seqlen_q = max((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist(), default=0)
    return kernel_backend(impl, q.device).paged_prefill_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, k_scale, v_scale,
        max_seqlen_q, window=window, softcap=softcap)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                           k_scale=1.0, v_scale=1.0, num_splits=None, impl=None,
                           max_seqlen_k=None, window=None, softcap=None) -> torch.Tensor:
    """One query per sequence at position ``context_lens[b] - 1`` over the paged KV.

    ``max_seqlen_k`` (the longest context) is read from ``context_lens`` when not given.
    """
    if max_seqlen_k is None:
        max_seqlen_k = max(context_lens.tolist(), default=0)
    return kernel_backend(impl, q.device).paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale, max_seqlen_k,
        num_splits, window=window, softcap=softcap)


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, pairs) -> None:
    """Copy whole blocks ``src -> dst`` for each ``(src, dst)`` in ``pairs`` (copy-on-write)."""
    if not pairs:
        return
    index = to_device(torch.tensor(pairs, dtype=torch.long).T.contiguous(), k_cache.device)
    src, dst = index[0], index[1]
    for cache in (k_cache, v_cache):
        # Bytes, not values: index_put has no float8 kernel on every device.
        raw = cache.view(torch.uint8) if reference.is_fp8(cache.dtype) else cache
        raw[dst] = raw[src]


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a host synchronisation: on CUDA through pinned
    memory with an asynchronous copy (a plain ``.to("cuda")`` waits for the copy)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
