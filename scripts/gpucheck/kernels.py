"""Each triton kernel against the torch reference on the device, within declared tolerances."""

from __future__ import annotations

import random

import torch

from gpucheck.plan import BLOCK_SIZE, Plan
from gpucheck.report import Report
from gpucheck.tensors import (
    KV_DTYPES,
    compare,
    dtype_of,
    free_memory,
    paged_case,
    random_cache,
    scales,
)
from kvscope import kernels

# Attention output: |triton - reference| <= ATOL + RTOL * |reference|, per query dtype: the
# kernels round softmax weights to the query dtype for the tensor cores (fp16: 2^-11, bf16: 2^-8
# relative, times |v| up to ~4) and the output to the query dtype (RTOL).
ATTN_TOL = {"float16": (2e-3, 2.0**-9), "bfloat16": (1.6e-2, 2.0**-7)}
# KV store: fp16/bf16 casts are exact; fp8 within one e4m3 step (x / scale may round differently
# on a GPU) plus the subnormal step, in stored units.
FP8_STORE_REL, FP8_STORE_ABS = 2.0**-3, 2.0**-9


def _tol_text(qname: str) -> str:
    atol, rtol = ATTN_TOL[qname]
    return f"err <= {atol:g} + {rtol:.2g}|ref|"


def check_kernels(report: Report, plan: Plan, device) -> None:
    triton, ref = kernels.kernel_backend("triton", device), kernels.kernel_backend("torch", device)
    seed = 0
    for i, (lname, heads, kv_heads, head_dim) in enumerate(plan.layouts):
        for j, (dname, cname, qname) in enumerate(KV_DTYPES):
            cdt, qdt = dtype_of(cname), dtype_of(qname)
            ks, vs = scales(cdt)
            # Each layout x dtype gets one decode shape, in rotation: every shape, layout and
            # dtype is covered without compiling and running the full product.
            for batch, max_ctx in [plan.decode[(i + j) % len(plan.decode)]]:
                case = f"decode {lname} {dname} b{batch} ctx<={max_ctx}"
                if report.out_of_time("kernels", case):
                    return
                seed += 1
                lens = _lengths(batch, max_ctx, seed)
                k, v, tables, gen = paged_case(lens, kv_heads, head_dim, cdt, device, seed)
                q = torch.randn(batch, heads, head_dim, generator=gen, device=device).to(qdt)
                ctx = torch.tensor(lens, dtype=torch.int32, device=device)
                args = (q, k, v, tables, ctx, head_dim**-0.5, ks, vs, max(lens))
                ok, data = compare(triton.paged_decode_attention(*args),
                                   ref.paged_decode_attention(*args), *ATTN_TOL[qname])
                report.add("kernels", case, ok, _err_text(data), _tol_text(qname), data)
            case = f"prefill {lname} {dname} {len(plan.prefill)} seqs, cached prefixes"
            if report.out_of_time("kernels", case):
                return
            seed += 1
            ctx_lens, new = [c for c, _ in plan.prefill], [n for _, n in plan.prefill]
            k, v, tables, gen = paged_case(ctx_lens, kv_heads, head_dim, cdt, device, seed)
            q = torch.randn(sum(new), heads, head_dim, generator=gen, device=device).to(qdt)
            cu = torch.tensor([0, *_cumsum(new)], dtype=torch.int32, device=device)
            ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
            args = (q, k, v, tables, cu, ctx, head_dim**-0.5, ks, vs, max(new))
            ok, data = compare(triton.paged_prefill_attention(*args),
                               ref.paged_prefill_attention(*args), *ATTN_TOL[qname])
            report.add("kernels", case, ok, _err_text(data), _tol_text(qname), data)
            seed += 1
            _check_store(report, f"store {lname} {dname} {plan.store_tokens} tokens", triton, ref,
                         plan.store_tokens, kv_heads, head_dim, cdt, qdt, device, seed)
    if not report.out_of_time("kernels", "int64 offsets"):
        report.attempt("kernels", "int64 offsets", _check_overflow, report, triton, ref, device,
                       *plan.overflow)


def _lengths(batch: int, max_ctx: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [max_ctx] + [rng.randint(1, max_ctx) for _ in range(batch - 1)]


def _cumsum(xs: list[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out


def _err_text(data: dict) -> str:
    return f"max err {data['max_abs_err']:.3g} ({data['err_over_tol']:.2f} of tol)"


def _check_store(report, case, triton, ref, num_tokens, kv_heads, head_dim, cdt, qdt, device,
                 seed, num_blocks=None):
    gen = torch.Generator(device=device).manual_seed(seed)
    num_blocks = num_blocks or -(-num_tokens // BLOCK_SIZE) * 2
    cache = random_cache(num_blocks, kv_heads, head_dim, cdt, device, gen)
    perm = torch.randperm(num_blocks * BLOCK_SIZE, generator=torch.Generator().manual_seed(seed))
    slots = perm[:num_tokens].clone()
    slots[::7] = -1  # padding tokens: skipped
    slots[1] = num_blocks * BLOCK_SIZE - 1  # the very last slot
    slots = slots.to(device)
    key = (torch.randn(num_tokens, kv_heads, head_dim, generator=gen, device=device) * 2).to(qdt)
    value = (torch.randn(num_tokens, kv_heads, head_dim, generator=gen, device=device) * 2).to(qdt)
    ks, vs = scales(cdt)
    results = []
    for backend in (triton, ref):
        k_cache, v_cache = cache.clone(), cache.clone()
        backend.store_kv(key, value, k_cache, v_cache, slots, ks, vs)
        results.append((k_cache, v_cache))
        del k_cache, v_cache
    if cdt == torch.float8_e4m3fn:
        pairs = zip(*results, strict=True)
        checks = [compare(t, r, FP8_STORE_ABS, FP8_STORE_REL) for t, r in pairs]
        ok, target = all(c[0] for c in checks), "<= 1 e4m3 step"
        data = {"err_over_tol": max(c[1]["err_over_tol"] for c in checks)}
        value = f"{data['err_over_tol']:.2f} of one e4m3 step"
    else:
        ok, target = all(torch.equal(t, r) for t, r in zip(*results, strict=True)), "bit-equal"
        data, value = {}, "bit-equal" if ok else "differs"
    report.add("kernels", case, ok, value, target, data)


def _check_overflow(report, triton, ref, device, batch: int, ctx_len: int) -> None:
    """64 sequences of 32k tokens (Llama 3 8B KV heads, fp16): the cache passes 2^31 elements,
    so any int32 offset arithmetic reads or writes the wrong place."""
    lens, kv_heads, head_dim = [ctx_len] * batch, 8, 128
    k, v, tables, gen = paged_case(lens, kv_heads, head_dim, torch.float16, device, seed=99,
                                   spare_blocks=4096 if ctx_len > 1024 else 3)
    report.add("kernels", "int64 offsets: cache elements", None, f"{k.numel():,}",
               f"> 2^31 = {2**31:,}", {"elements": k.numel()})
    q = torch.randn(batch, 32, head_dim, generator=gen, device=device).half()
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    args = (q, k, v, tables, ctx, head_dim**-0.5, 1.0, 1.0, ctx_len)
    ok, data = compare(triton.paged_decode_attention(*args), ref.paged_decode_attention(*args),
                       *ATTN_TOL["float16"])
    report.add("kernels", f"int64 offsets: decode {batch} x {ctx_len} GQA 32/8 d128 fp16", ok,
               _err_text(data), _tol_text("float16"), data)
    num_blocks = k.shape[0]
    del k, v, q, args
    _check_store(report, f"int64 offsets: store into that {num_blocks}-block cache", triton, ref,
                 min(4096, batch * ctx_len), kv_heads, head_dim, torch.float16, torch.float16,
                 device, seed=98, num_blocks=num_blocks)
    free_memory(device)
