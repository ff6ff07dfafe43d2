"""Random paged KV caches, comparison within a tolerance, and timing: what the checks share."""

from __future__ import annotations

import gc
import statistics
import time

import torch

from gpucheck.plan import BLOCK_SIZE

KV_DTYPES = [("fp16", "float16", "float16"), ("bf16", "bfloat16", "bfloat16"),
             ("fp8", "float8_e4m3fn", "bfloat16")]  # name, cache dtype, query (model) dtype


def dtype_of(name: str):
    return getattr(torch, name)


def scales(cache_dtype) -> tuple[float, float]:
    return (0.5, 0.25) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)


def random_cache(num_blocks, kv_heads, head_dim, cache_dtype, device, gen):
    """Random stored values (garbage everywhere: a wrong slot read shows up)."""
    x = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=gen, device=device)
    if cache_dtype == torch.float8_e4m3fn:
        return (x * 2).clamp_(-448, 448).to(cache_dtype)
    return x.to(cache_dtype)


def paged_case(lens, kv_heads, head_dim, cache_dtype, device, seed, spare_blocks=3):
    """K/V caches and int32 block tables of shuffled blocks holding sequences of ``lens``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    need = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    tables = torch.zeros(len(lens), max(need) + 1, dtype=torch.int32)  # + a padded column
    start = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[start:start + n].to(torch.int32)
        start += n
    k = random_cache(num_blocks, kv_heads, head_dim, cache_dtype, device, gen)
    v = random_cache(num_blocks, kv_heads, head_dim, cache_dtype, device, gen)
    return k, v, tables.to(device), gen


def compare(got, want, atol: float, rtol: float) -> tuple[bool, dict]:
    diff = (got.float() - want.float()).abs()
    ratio = (diff / (atol + rtol * want.float().abs())).max().item()
    return ratio <= 1.0, {"max_abs_err": diff.max().item(), "err_over_tol": ratio}


def free_memory(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_call(fn, iters: int, device) -> float:
    """Median seconds of ``fn()`` over ``iters`` calls, after a warm-up call on a GPU
    (compilation, first touch): CUDA events there, the CPU's clock in the dry run."""
    if device.type == "cuda":
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
