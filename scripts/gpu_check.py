#!/usr/bin/env python3
"""GPU readiness check: proves the CUDA half of kvscope in one run of under five minutes.

    python3 scripts/gpu_check.py --out DIR [--quick] [--model HF_FOLDER]
    python3 scripts/gpu_check.py --cpu-dry-run --out DIR   # same code paths, tiny, on the CPU

1. triton kernels (KV store, paged prefill over a cached prefix, split-K decode) against the
   torch reference: GQA and MQA, head_dim 64/128, block 16, fp16/bf16/fp8 KV, contexts to 32k,
   batch 1..64, a cache past 2^31 elements, within the tolerances declared below;
2. engine greedy tokens against transformers (a random Llama with Llama 3.1 8B shapes, 2 layers,
   bfloat16; ``--model`` adds a real folder, e.g. SmolLM2);
3. decode kernel KV bandwidth (bytes read / kernel time from CUDA events) at 8k and 32k context,
   batch 1/16/64, against the nominal peak and a device-to-device copy measured in the same run;
4. no host synchronisation in a prefill and a decode forward (``torch.cuda.set_sync_debug_mode``)
   and engine step timing from CUDA events;
5. NVML read as the Device panel reads it (``kvscope.app.nvml_reader``).
One table is printed and written to ``DIR/gpu_check.json``; the exit status is 1 if a check
failed. kvscope is imported from this source tree (no install; no Qt, psutil or sqlite-utils).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import types
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOMINAL_PEAK_BYTES_S = {"H200": 4.8e12}  # HBM3e, by GPU name
BANDWIDTH_TARGET = 0.7  # of the nominal peak, decode at 32k context, batch 16
BLOCK_SIZE = 16

# Declared tolerances. Attention output: |triton - reference| <= ATOL + RTOL * |reference|, per
# query dtype: the kernels round softmax weights to the query dtype for the tensor cores (fp16:
# 2^-11, bf16: 2^-8 relative, times |v| up to ~4) and the output to the query dtype (RTOL).
ATTN_TOL = {"float16": (2e-3, 2.0**-9), "bfloat16": (1.6e-2, 2.0**-7)}
# KV store: fp16/bf16 casts are exact; fp8 within one e4m3 step (x / scale may round differently
# on a GPU) plus the subnormal step, in stored units.
FP8_STORE_REL, FP8_STORE_ABS = 2.0**-3, 2.0**-9


def import_kvscope_from_source() -> None:
    """``kvscope.engine`` is ``ROOT/engine`` and so on (pyproject's package-dir): a ``kvscope``
    package whose search path is the repository root gives exactly that mapping."""
    package = types.ModuleType("kvscope")
    package.__path__ = [str(ROOT)]
    sys.modules["kvscope"] = package


@dataclass
class Plan:
    """Shapes of one run: the GPU's, a quicker GPU subset, or tiny ones for the CPU dry run."""

    layouts: list[tuple[str, int, int, int]]  # name, query heads, KV heads, head_dim
    decode: list[tuple[int, int]]             # batch, longest context
    prefill: list[tuple[int, int]]            # (context incl. new tokens, new tokens) per seq
    store_tokens: int
    overflow: tuple[int, int]                 # batch x context: past 2^31 cache elements
    bandwidth: list[tuple[int, int]]          # context, batch; the last is the target case
    sweep: list[tuple]                        # (num_splits, BLOCK_N, num_warps) at the target
    timing_iters: int
    model: dict                               # transformers.LlamaConfig fields
    prompt_lens: list[int]
    max_tokens: int
    chunk_tokens: int                         # token budget per step of the chunked engine run

    @staticmethod
    def make(dry: bool, quick: bool) -> Plan:
        llama_8b = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                        rms_norm_eps=1e-5, max_position_embeddings=131072)
        if dry:
            return Plan([("GQA 4/2 d64", 4, 2, 64), ("MQA 2/1 d128", 2, 1, 128)],
                        [(1, 70), (3, 40)], [(40, 20), (9, 9), (5, 1)], 24, (2, 40),
                        [(32, 1), (32, 2)], [(2, 32, 4)], 1,
                        dict(vocab_size=320, hidden_size=64, intermediate_size=128,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             rms_norm_eps=1e-5, max_position_embeddings=512),
                        [40, 9, 3], 5, 16)
        layouts = [("GQA 32/8 d128", 32, 8, 128), ("GQA 9/3 d64", 9, 3, 64),
                   ("MQA 16/1 d128", 16, 1, 128)]
        if quick:
            return Plan(layouts[:2], [(1, 8192), (16, 4096)], [(8192, 256), (700, 700), (17, 1)],
                        2048, (64, 32768), [(8192, 16), (32768, 16)], [(8, 32, 4), (32, 32, 4)],
                        10,
                        llama_8b,
                        [500, 37, 5], 16, 128)
        return Plan(layouts, [(1, 32768), (16, 8192), (64, 2048)],
                    [(32768, 512), (8192, 2048), (1500, 1500), (17, 1)], 4096, (64, 32768),
                    [(8192, 1), (8192, 16), (8192, 64), (32768, 1), (32768, 64), (32768, 16)],
                    [(s, n, w) for s in (8, 32) for n in (32, 64) for w in (4, 8)], 20, llama_8b,
                    [600, 300, 37, 5], 24, 128)


@dataclass
class Row:
    section: str
    case: str
    ok: bool | None  # None: informational, or not measurable here (the CPU dry run)
    value: str
    target: str = ""
    data: dict = field(default_factory=dict)


class Report:
    def __init__(self, deadline: float):
        self.rows: list[Row] = []
        self.errors: list[dict] = []
        self.seconds: dict[str, float] = {}
        self.deadline = deadline

    def add(self, *args, **kwargs) -> None:
        self.rows.append(Row(*args, **kwargs))
        r = self.rows[-1]
        print(f"  {_mark(r.ok)} {r.section}: {r.case}: {r.value}", flush=True)

    def out_of_time(self, section: str, case: str) -> bool:
        if time.monotonic() < self.deadline:
            return False
        self.add(section, case, None, "skipped: time budget spent")
        return True

    def run(self, section: str, fn, *args) -> None:
        print(f"[{section}]", flush=True)
        t0 = time.monotonic()
        self.attempt(section, "section aborted", fn, self, *args)
        self.seconds[section] = round(time.monotonic() - t0, 1)

    def attempt(self, section: str, case: str, fn, *args) -> None:
        """Run ``fn(*args)``; an exception becomes a failed row: one broken check must not
        hide the others. The traceback goes to the JSON."""
        try:
            fn(*args)
        except Exception as e:
            line = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self.add(section, case, False, line[:200])
            self.errors.append({"section": section, "case": case,
                                "traceback": traceback.format_exc()})

    def table(self) -> str:
        cols = [("section", 10), ("case", 52), ("ok", 4), ("value", 52), ("target", 0)]
        lines = ["  ".join(name.ljust(w) for name, w in cols).rstrip()]
        for r in self.rows:
            cells = zip([r.section, r.case, _mark(r.ok), r.value, r.target], cols, strict=True)
            lines.append("  ".join(str(c).ljust(w) for c, (_, w) in cells).rstrip())
        return "\n".join(lines)

    @property
    def failed(self) -> bool:
        return any(r.ok is False for r in self.rows)


def _mark(ok: bool | None) -> str:
    return {True: "ok", False: "FAIL", None: "-"}[ok]


# ------------------------------------------------------------------------------ 1. kernels
KV_DTYPES = [("fp16", "float16", "float16"), ("bf16", "bfloat16", "bfloat16"),
             ("fp8", "float8_e4m3fn", "bfloat16")]  # name, cache dtype, query (model) dtype


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def _scales(cache_dtype) -> tuple[float, float]:
    import torch

    return (0.5, 0.25) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)


def random_cache(num_blocks, kv_heads, head_dim, cache_dtype, device, gen):
    """Random stored values (garbage everywhere: a wrong slot read shows up)."""
    import torch

    x = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=gen, device=device)
    if cache_dtype == torch.float8_e4m3fn:
        return (x * 2).clamp_(-448, 448).to(cache_dtype)
    return x.to(cache_dtype)


def paged_case(lens, kv_heads, head_dim, cache_dtype, device, seed, spare_blocks=3):
    """K/V caches and int32 block tables of shuffled blocks holding sequences of ``lens``."""
    import torch

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


def _tol_text(qname: str) -> str:
    atol, rtol = ATTN_TOL[qname]
    return f"err <= {atol:g} + {rtol:.2g}|ref|"


def check_kernels(report: Report, plan: Plan, device) -> None:
    import torch

    from kvscope import kernels

    triton, ref = kernels.kernel_backend("triton", device), kernels.kernel_backend("torch", device)
    seed = 0
    for i, (lname, heads, kv_heads, head_dim) in enumerate(plan.layouts):
        for j, (dname, cname, qname) in enumerate(KV_DTYPES):
            cdt, qdt = _dtype(cname), _dtype(qname)
            ks, vs = _scales(cdt)
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
    import random

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
    import torch

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
    ks, vs = _scales(cdt)
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
    import torch

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
    _free(device)


def _free(device) -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- 3. bandwidth
def time_call(fn, iters: int, device) -> float:
    """Median seconds of ``fn()`` over ``iters`` calls after a warm-up call (compilation,
    first touch): CUDA events on a GPU."""
    import torch

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


def check_bandwidth(report: Report, plan: Plan, device) -> None:
    import torch

    from kvscope import kernels

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
        _free(device)


@contextmanager
def _decode_tuning(tuning):
    """Try other tile sizes for the split-K decode kernel: (num_splits, BLOCK_N, num_warps)."""
    from kvscope.kernels import triton_attention as ta

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
    import torch

    src = torch.empty(num_bytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    return time_call(partial(dst.copy_, src), iters, device)


# ------------------------------------------------------------------------------- 2. engine
def build_random_llama(folder: Path, plan: Plan, device):
    """A random bf16 Llama (2 layers, ``plan.model`` shapes) saved as a real HF folder."""
    import torch
    import transformers

    config = transformers.LlamaConfig(**plan.model, num_hidden_layers=2, bos_token_id=1,
                                      eos_token_id=2, tie_word_embeddings=False,
                                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norms start at 1: make them matter
                p.add_(torch.randn_like(p) * 0.2)
    model = model.to(torch.bfloat16).eval()
    model.save_pretrained(folder)
    return model


def hf_greedy(model, prompt: list[int], steps: int, device):
    """transformers' own forward over the whole sequence at every step (no cache: independent
    of transformers' cache API, which moves between versions). Returns tokens and logits."""
    import torch

    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.tensor([prompt + tokens], device=device)
            row = model(input_ids=ids).logits[0, -1].float()
            logits.append(row)
            tokens.append(int(row.argmax()))
    return tokens, logits


def _tie_margin(row) -> float:
    """Two units in the last place of bf16 at the top logit: closer logits are a tie."""
    top = max(abs(row.max().item()), 1e-3)
    return 2 * 2.0 ** (math.floor(math.log2(top)) - 7)


def compare_greedy(ours: list[int], ref: list[int], ref_logits) -> tuple[bool, str]:
    """Equal, or first differing at a near-tie of transformers' own logits (bf16 rounding)."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            margin = (ref_logits[i].max() - ref_logits[i][a]).item()
            tie = margin <= _tie_margin(ref_logits[i])
            return tie, f"{'near-tie' if tie else 'DIFFERS'} at token {i} (margin {margin:.3g})"
    return True, "equal"


def check_engine(report: Report, plan: Plan, device, model_folder: str | None) -> None:
    import random

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        hf = build_random_llama(folder, plan, device)
        rng = random.Random(0)
        vocab = plan.model["vocab_size"]
        prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in plan.prompt_lens]
        # A prompt sharing the first one's first blocks: a prefix-cache hit when run after it.
        shared = prompts[0][: (len(prompts[0]) // 2) // BLOCK_SIZE * BLOCK_SIZE]
        prompts.append(shared + [rng.randrange(3, vocab) for _ in range(7)])
        refs = [hf_greedy(hf, p, plan.max_tokens, device) for p in prompts]
        del hf
        _free(device)
        shapes = "Llama-3.1-8B shapes" if plan.model["hidden_size"] == 4096 else "tiny"
        budget = sum(len(p) for p in prompts) + 64
        for label, tokens_per_step in (("one prefill step", budget),
                                       ("chunked prefill + prefix hit", plan.chunk_tokens)):
            if report.out_of_time("engine", label):
                return
            case = f"random Llama ({shapes}, 2 layers, bf16): {label}"
            report.attempt("engine", case, _greedy_row, report, case, folder, prompts, refs, plan,
                           device, tokens_per_step)
        if not report.out_of_time("sync", "forward"):
            report.attempt("sync", "forward", check_sync, report, folder, plan, device)
            _free(device)
            report.attempt("sync", "engine decode step", _check_engine_step, report, folder,
                           device)
    if model_folder and not report.out_of_time("engine", model_folder):
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(
            model_folder, dtype=torch.bfloat16).to(device).eval()
        prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(n)]
                   for n in plan.prompt_lens]
        refs = [hf_greedy(hf, p, plan.max_tokens, device) for p in prompts]
        del hf
        case = f"{Path(model_folder).name} bf16"
        report.attempt("engine", case, _greedy_row, report, case, model_folder, prompts, refs,
                       plan, device, plan.chunk_tokens)


def _greedy_row(report, case, folder, prompts, refs, plan, device, tokens_per_step) -> None:
    from kvscope.engine import Engine, EngineConfig, SamplingParams

    engine = Engine.from_pretrained(str(folder), EngineConfig(
        device=device.type, dtype="bfloat16", num_blocks=1024, block_size=BLOCK_SIZE,
        max_num_batched_tokens=tokens_per_step))
    outs = engine.generate(prompts, SamplingParams(max_tokens=plan.max_tokens, ignore_eos=True))
    results = [compare_greedy(o.token_ids, r[0], r[1]) for o, r in zip(outs, refs, strict=True)]
    hits = sum(o.num_cached_tokens for o in outs)
    ok = all(r[0] for r in results)
    equal = sum(r[1] == "equal" for r in results)
    value = "; ".join([f"{equal}/{len(results)} equal", f"{hits} prompt tokens cached",
                       *(r[1] for r in results if r[1] != "equal")])
    report.add("engine", case, ok, value, "tokens equal (or a bf16 near-tie)",
               {"per_prompt": [r[1] for r in results], "cached_tokens": hits,
                "steps": engine.num_steps})
    del engine
    _free(device)


# --------------------------------------------------------------------------------- 4. sync
def check_sync(report: Report, folder: Path, plan: Plan, device) -> None:
    """A prefill forward (one new sequence, one over a cached prefix) and a decode forward
    with a copy-on-write block copy make no host synchronisation once warmed up."""
    from kvscope.engine.host_sync import no_host_sync
    from kvscope.engine.loader import load_model
    from kvscope.engine.model_runner import ModelRunner, SeqChunk

    impl = "triton"  # on the CPU too: the dry run checks the triton path under the interpreter
    runner = ModelRunner(load_model(folder, device, "bfloat16"), num_blocks=64,
                         block_size=BLOCK_SIZE, kernel_impl=impl)

    def forwards(first_block: int):
        a = list(range(first_block, first_block + 4))
        b = list(range(first_block + 4, first_block + 8))
        prefill = [SeqChunk(list(range(3, 43)), 0, a[:3]), SeqChunk(list(range(5, 25)), 0, b[:2])]
        mixed = [SeqChunk([7] * 8, 40, a[:3]), SeqChunk([9] * 4, 20, b[:2])]
        decode = [SeqChunk([11], 48, a[:4]), SeqChunk([12], 24, b[:2])]
        return prefill, mixed, decode, [(a[0], first_block + 30)]

    prefill, mixed, decode, copies = forwards(0)
    for chunks in (prefill, mixed, decode):  # warm-up: kernel compilation, first transfers
        runner.run(chunks, copies)
    prefill, mixed, decode, copies = forwards(10)
    runner.run(prefill)
    for name, chunks, cp in (("prefill over a cached prefix", mixed, ()),
                             ("decode with a block copy", decode, copies)):
        try:
            with no_host_sync(device):
                runner.run(chunks, cp)
            ok, value = True, "no host sync"
        except RuntimeError as e:
            ok, value = False, str(e).splitlines()[0][:120]
        t = time_call(lambda c=chunks: runner.run(c), plan.timing_iters, device)
        clock = "CUDA events" if device.type == "cuda" else "perf_counter (CPU)"
        report.add("sync", f"{name} forward (2 seqs)", ok, f"{value}; {t * 1e3:.2f} ms ({clock})",
                   "no sync", {"seconds": t})


def _check_engine_step(report: Report, folder: Path, device) -> None:
    """An engine decode step: its host syncs (the sampler's transfer is the one expected) and
    whether its forward timing came from CUDA events; then the triton kernels compiled while
    contexts grow past block and split boundaries (none should be: a compile stalls a step)."""
    import torch

    from kvscope.engine import Engine, EngineConfig, SamplingParams

    case, cuda = "engine decode step (4 seqs)", device.type == "cuda"
    engine = Engine.from_pretrained(str(folder), EngineConfig(
        device=device.type, dtype="bfloat16", num_blocks=256, block_size=BLOCK_SIZE))
    for n in (250, 9, 33, 4):  # the longest crosses 256 tokens: the decode split count changes
        engine.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=24, ignore_eos=True))
    for _ in range(3):  # prefill, then decode steps
        engine.step()
    events = []
    real_event = torch.cuda.Event

    def counting_event(*args, **kwargs):
        events.append(kwargs.get("enable_timing", False))
        return real_event(*args, **kwargs)

    previous = torch.cuda.get_sync_debug_mode() if cuda else None
    try:
        if cuda:
            torch.cuda.Event = counting_event
            torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.step()
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(previous)
            torch.cuda.Event = real_event
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    engine.step()  # a step later: where the timing may be read from its events
    decode_s = max(r.decode_s for r in engine.step_records[-2:])
    timed = sum(events) >= 2 and decode_s > 0
    value = (f"{syncs} host syncs; timing from CUDA events: {'yes' if timed else 'no'} "
             f"(decode {decode_s * 1e3:.2f} ms)")
    report.add("sync", case, syncs <= 1 and timed if cuda else None,
               value if cuda else "CPU dry run: no CUDA syncs or events",
               "<= 1 sync; CUDA-event timing",
               {"syncs": syncs, "timing_events": sum(events), "decode_s": decode_s})
    before = _compiled_variants()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    after = _compiled_variants()
    grown = None if before is None or after is None else after - before
    report.add("sync", f"kernel compilations in {steps} later decode steps",
               None if grown is None else grown == 0,
               "not countable in this triton" if grown is None else str(grown), "0",
               {"before": before, "after": after})
    del engine
    _free(device)


def _compiled_variants() -> int | None:
    """Compiled variants of the attention and store kernels (triton internals: best effort)."""
    from kvscope.kernels import triton_attention, triton_store

    kernels = (triton_attention._prefill_kernel, triton_attention._decode_split_kernel,
               triton_attention._decode_reduce_kernel, triton_store._store_kv_kernel)
    try:
        return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())
    except (AttributeError, TypeError, IndexError, KeyError):
        return None


# --------------------------------------------------------------------------------- 5. NVML
def check_nvml(report: Report, plan: Plan, device) -> None:
    import torch

    from kvscope.app.nvml_reader import NvmlReader

    reader = NvmlReader()
    try:
        if not reader.has_gpu:
            report.add("nvml", "Device panel reading", None if device.type != "cuda" else False,
                       f"no GPU view (NVML: {reader.gpu_error})")
            return
        keep = torch.empty(2**28, dtype=torch.uint8, device=device)  # 256 MiB held by us
        gpus = reader.read_gpus({os.getpid()})
        for g in gpus:
            mine = "n/a" if g.process_memory is None else f"{g.process_memory / 2**30:.2f} GiB"
            value = (f"{g.name}: {g.memory_used / 2**30:.1f}/{g.memory_total / 2**30:.1f} GiB, "
                     f"util {g.utilization:.0f}%, this process {mine}")
            ok = None
            if device.type == "cuda" and g.index == (device.index or 0):
                free, total = torch.cuda.mem_get_info(device)
                used = total - free
                ok = abs(g.memory_total - total) < 2**30 and abs(g.memory_used - used) < 2**30
                value += f"; torch sees {used / 2**30:.1f} GiB used"
            report.add("nvml", f"GPU {g.index}", ok, value, "NVML used ~ torch used (1 GiB)",
                       asdict(g))
        del keep
        if not gpus:
            report.add("nvml", "read", False, f"read failed (NVML: {reader.gpu_error})")
    finally:
        reader.close()


# ----------------------------------------------------------------------------------- main
# The bandwidth figure before the long kernel sweep, so a spent budget skips kernel cases rather
# than the figure; the engine section includes the sync checks.
SECTIONS = ("nvml", "bandwidth", "kernels", "engine")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="gpu_check_out", help="folder for gpu_check.json")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="the same code paths at tiny shapes on the CPU (triton interpreted)")
    p.add_argument("--quick", action="store_true", help="fewer and smaller GPU cases")
    p.add_argument("--model", help="also check greedy equivalence on this HF model folder")
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--budget-s", type=float, default=270.0,
                   help="stop starting new cases after this many seconds")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.model and not (Path(args.model) / "config.json").is_file():
        print(f"gpu_check: --model {args.model} is not a folder with config.json",
              file=sys.stderr)
        return 2
    if args.cpu_dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any triton kernel is decorated
    import_kvscope_from_source()
    import torch

    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; use --cpu-dry-run", file=sys.stderr)
        return 2
    started = time.monotonic()
    device = torch.device("cpu" if args.cpu_dry_run else "cuda")
    plan = Plan.make(args.cpu_dry_run, args.quick)
    report = Report(started + args.budget_s)
    for name in SECTIONS:
        if name not in args.only:
            continue
        if name == "engine":
            report.run(name, check_engine, plan, device, args.model)
        else:
            report.run(name, {"kernels": check_kernels, "bandwidth": check_bandwidth,
                              "nvml": check_nvml}[name], plan, device)
    print(report.table())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = _meta(args, device, time.monotonic() - started)
    meta["section_seconds"] = report.seconds
    (out / "gpu_check.json").write_text(json.dumps(
        {"meta": meta, "rows": [asdict(r) for r in report.rows], "errors": report.errors},
        indent=1, default=str))
    print(f"{'FAILED' if report.failed else 'passed'} in {meta['seconds']:.0f} s; "
          f"wrote {out / 'gpu_check.json'}")
    return 1 if report.failed else 0


def _meta(args, device, seconds: float) -> dict:
    import torch

    import kvscope.engine

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "transformers"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    return {"dry_run": args.cpu_dry_run, "quick": args.quick, "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "versions": versions, "kvscope_source": str(Path(kvscope.engine.__file__).parent),
            "seconds": round(seconds, 1)}


if __name__ == "__main__":
    sys.exit(main())
