"""Attention and KV-store kernels: triton for CUDA, a torch reference for the CPU and tests."""

from kvscope.kernels.api import (
    KernelBackend,
    check_fp8_support,
    copy_blocks,
    kernel_backend,
    kv_cache_dtype_of,
    paged_decode_attention,
    paged_prefill_attention,
    store_kv,
    to_device,
)
from kvscope.kernels.cpu import hugepage_weights
from kvscope.kernels.reference import FP8_MAX

__all__ = [
    "FP8_MAX",
    "KernelBackend",
    "check_fp8_support",
    "copy_blocks",
    "hugepage_weights",
    "kernel_backend",
    "kv_cache_dtype_of",
    "paged_decode_attention",
    "paged_prefill_attention",
    "store_kv",
    "to_device",
]
