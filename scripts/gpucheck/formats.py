"""The quantized KV formats on the triton kernels: the same passes (prefill over cached prefixes,
decode steps) on the triton and the torch backends, each with its own cache, must store the same
bytes and attend within the kernels section's tolerance; and decode time per format against a
float16 cache at one long context."""

from __future__ import annotations

import torch

from gpucheck.kernels import ATTN_TOL, _err_text, _tol_text
from gpucheck.kv_passes import World, passes
from gpucheck.plan import BLOCK_SIZE, Plan
from gpucheck.report import Report
from gpucheck.tensors import compare, free_memory, time_call

FORMATS = ("fp8_per_head", "int8_per_token_head", "int4_per_token_head", "kivi4", "kivi2")
MODEL_DTYPE = "float16"


def check_formats(report: Report, plan: Plan, device) -> None:
    # the CPU dry run (the triton interpreter, in the test suite): its first layout only; the
    # formats' kernels on every layout are tests/kernels/test_triton_kv_formats.py's
    layouts = plan.layouts[:1] if device.type == "cpu" else plan.layouts
    for lname, heads, kv_heads, head_dim in layouts:
        for name in FORMATS:
            case = f"{name} {lname}"
            if report.out_of_time("formats", case):
                return
            report.attempt("formats", case, _check_passes, report, case, plan, device, name,
                           heads, kv_heads, head_dim)
            free_memory(device)
    lname, heads, kv_heads, head_dim = plan.layouts[0]
    context, batch = plan.bandwidth[-1]
    base = None
    for name in ("float16", *FORMATS):
        case = f"decode time {name} {lname} ctx {context} b{batch}"
        if report.out_of_time("formats", case):
            return
        seconds = _decode_seconds(plan, device, name, heads, kv_heads, head_dim, context, batch)
        base = base or seconds
        report.add("formats", case, None, f"{seconds * 1e6:.0f} us ({seconds / base:.2f}x "
                   "float16)", "measured", {"seconds": seconds, "vs_float16": seconds / base})
        free_memory(device)


def _scales(name, kv_heads):
    if name != "fp8_per_head":
        return (1.0, 1.0)
    return (torch.linspace(0.06, 0.03, kv_heads)[:, None],
            torch.linspace(0.03, 0.015, kv_heads)[:, None])


def _check_passes(report, case, plan, device, name, heads, kv_heads, head_dim) -> None:
    ctx_lens, new = [c for c, _ in plan.prefill], [n for _, n in plan.prefill]
    schedule = [[c - n for c, n in plan.prefill], new, [1] * len(new), [1] * len(new)]
    if not any(schedule[0]):
        schedule = schedule[1:]
    num_blocks = sum(-(-(c + 2) // BLOCK_SIZE) for c in ctx_lens) + 2
    dtype = getattr(torch, MODEL_DTYPE)
    worlds = [World.make(impl, name, num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype,
                         scales=_scales(name, kv_heads), device=device,
                         max_seqs=2 * len(new))  # a pass may open a group before closing one
              for impl in ("triton", "torch")]
    runs = passes(schedule, heads, kv_heads, head_dim, BLOCK_SIZE, num_blocks, dtype,
                  seed=len(name), device=device)
    results = [compare(*(w.run(p) for w in worlds), *ATTN_TOL[MODEL_DTYPE]) for p in runs]
    ok, data = max(results, key=lambda r: (not r[0], r[1]["err_over_tol"]))
    report.add("formats", f"attention {case} (worst of {len(runs)} passes)", ok,
               _err_text(data), _tol_text(MODEL_DTYPE), data)
    tri, ref = worlds
    same = [_same(a, b, name) for a, b in zip((tri.cache, *tri.meta), (ref.cache, *ref.meta),
                                              strict=True)]
    if ref.residual is not None:
        same.append(torch.equal(tri.residual.k, ref.residual.k))
    report.add("formats", f"store {case}", all(same), "bit-equal" if all(same) else
               f"differs in {same.count(False)} of {len(same)} tensors", "bit-equal")


def _same(a, b, name) -> bool:
    if name == "fp8_per_head":  # +-0.0 below the smallest subnormal: as values
        return torch.equal(a.float(), b.float())
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _decode_seconds(plan, device, name, heads, kv_heads, head_dim, context, batch) -> float:
    """The triton decode kernel's time over ``batch`` sequences of ``context`` tokens stored
    (by the triton store) in format ``name``."""
    num_blocks = batch * (-(-(context + 1) // BLOCK_SIZE)) + 1
    dtype = getattr(torch, MODEL_DTYPE)
    world = World.make("triton", name, num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype,
                       scales=_scales(name, kv_heads), device=device, max_seqs=batch)
    prefill, step = passes([[context] * batch, [1] * batch], heads, kv_heads, head_dim,
                           BLOCK_SIZE, num_blocks, dtype, seed=5, device=device)
    world.store(prefill)
    sides = world.store(step)
    return time_call(lambda: world.attend(step, sides), plan.timing_iters, device)
