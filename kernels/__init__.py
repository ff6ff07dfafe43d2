"""Attention and KV-store kernels: triton for CUDA, a torch reference for the CPU and tests."""

from kvscope.kernels.api import (
    copy_blocks,
    kv_cache_dtype_of,
    paged_decode_attention,
    paged_prefill_attention,
    store_kv,
)

__all__ = [
    "copy_blocks",
    "kv_cache_dtype_of",
    "paged_decode_attention",
    "paged_prefill_attention",
    "store_kv",
]
