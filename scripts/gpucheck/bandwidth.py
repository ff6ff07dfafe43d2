"""The decode kernel's achieved KV bandwidth against the nominal peak and a measured copy."""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch

from gpucheck.plan import Plan
from gpucheck.report import Report
from gpucheck.tensors import free_memory, paged_case, time_call
from kvscope import kernels
from kvscope.kernels import triton_attention as ta

NOMINAL_PEAK_BYTES_S = {"H200": 4.8e12}  # HBM3e, by GPU name
BANDWIDTH_TARGET = 0.7  # of the nominal peak, decode at 32k context, batch 16


def check_bandwidth(report: Report, plan: Plan, device) -> None:
    triton = kernels.kernel_backend("triton", device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = next((p for name, p in NOMINAL_PEAK_BYTES_S.items() if name in gpu), None)
    measurable = device.type == "cuda"
    heads, kv_heads, head_dim = 32, 8, 128  # Llama 3 8B attention
    biggest = max(c * b for c, b in plan.bandwidth)
    copy_bytes = biggest * kv_heads * head_dim * 2 * 2  # as many bytes as the largest K+V read
    copy_bw = 2 * copy_bytes / _copy_time(copy_bytes, plan.timing_iters, device)  # read+write
    report.add("bandwidth", f"device-to-device copy {copy_bytes / 2**30:.1f} GiB", None,
               f"{copy_bw / 1e12:.2f} TB/s" + (f" ({copy_bw / peak:.2f} of peak)" if peak else ""),
               f"nominal peak {peak / 1e12:.1f} TB/s" if peak else "no nominal peak known",
               {"bytes_per_s": copy_bw})
    for ctx_len, batch in plan.bandwidth:
        case = f"decode GQA 32/8 d128 fp16 ctx {ctx_len} b{batch}"
        if report.out_of_time("bandwidth", case):
            return
        k, v, tables, gen = paged_case([ctx_len] * batch, kv_heads, head_dim, torch.float16,
                                       device, seed=ctx_len + batch)
        q = torch.randn(batch, heads, head_dim, generator=gen, device=device).half()
        ctx = torch.tensor([ctx_len] * batch, dtype=torch.int32, device=device)
        kv_bytes = 2 * batch * ctx_len * kv_heads * head_dim * 2
        is_target = (ctx_len, batch) == plan.bandwidth[-1]
        args = (q, k, v, tables, ctx, head_dim**-0.5, 1.0, 1.0, ctx_len)
        for tuning in [None, *plan.sweep] if is_target else [None]:
            with _decode_tuning(tuning):
                t = time_call(partial(triton.paged_decode_attention, *args,
                                      tuning and tuning[0]), plan.timing_iters, device)
            bw = kv_bytes / t
            of_peak = bw / peak if peak else None
            ok = None
            if is_target and tuning is None and measurable and peak:
                ok = of_peak >= BANDWIDTH_TARGET
            label = case + (" splits={} BLOCK_N={} warps={}".format(*tuning) if tuning else "")
            value = (f"{bw / 1e12:.2f} TB/s, {t * 1e6:.0f} us; {bw / copy_bw:.2f} of copy"
                     + (f", {of_peak:.2f} of peak" if of_peak else ""))
            if not measurable:
                value = "CPU dry run (interpreter): path only, not a measurement"
            target = f">= {BANDWIDTH_TARGET} of peak" if is_target and tuning is None else ""
            report.add("bandwidth", label, ok, value, target,
                       {"bytes": kv_bytes, "seconds": t, "bytes_per_s": bw,
                        "of_peak": of_peak, "of_copy": bw / copy_bw, "tuning": tuning})
        del k, v, q, args
        free_memory(device)


@contextmanager
def _decode_tuning(tuning):
    """Try other tile sizes for the split-K decode kernel: (num_splits, BLOCK_N, num_warps)."""
    if tuning is None:
        yield
        return
    saved = ta.BLOCK_N, ta.DECODE_NUM_WARPS
    ta.BLOCK_N, ta.DECODE_NUM_WARPS = tuning[1], tuning[2]
    try:
        yield
    finally:
        ta.BLOCK_N, ta.DECODE_NUM_WARPS = saved


def _copy_time(num_bytes: int, iters: int, device) -> float:
    src = torch.empty(num_bytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    return time_call(partial(dst.copy_, src), iters, device)
