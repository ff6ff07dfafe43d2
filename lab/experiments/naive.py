"""naive-vs-cached: the loop that recomputes the whole sequence every step against the KV
cache, per-step latency over the sequence length and the total ratio."""

from __future__ import annotations

from kvscope.lab.experiments.fit import linear_fit, quadratic_fit, ratio
from kvscope.lab.experiments.result import Result

NAME = "naive-vs-cached"
CLAIM = ("Without a KV cache every step recomputes the whole sequence, so per-step time grows "
         "linearly with length and total time quadratically; with one it stays flat: 25 s vs "
         "2.2 s (about 11x) for a 2,000-token prompt and 300 output tokens on an H100.")


def measure(bench, quick: bool = False) -> Result:
    prompt_len, out_len = (32, 8) if quick else (128, 128)
    prompt = bench.prompt(prompt_len, seed=1)
    bench.plan(2)
    step_ms, totals = {}, {}
    for mode, cached in (("naive", False), ("cached", True)):
        _, records = bench.run(bench.engine(enable_kv_cache=cached), [prompt], out_len)
        step_ms[mode] = [1e3 * (r.prefill_s + r.decode_s) for r in records if r.batch_size]
        totals[mode] = sum(step_ms[mode])
    n = min(len(step_ms["naive"]), len(step_ms["cached"]))
    rows = [[i, prompt_len + i, step_ms["naive"][i], step_ms["cached"][i]] for i in range(n)]
    return summarize(rows, totals, prompt_len, out_len)


def summarize(rows, totals: dict[str, float], prompt_len: int, out_len: int) -> Result:
    """rows: [step, context tokens, naive ms, cached ms]; the first step (the prefill) is left
    out of the per-step fits."""
    decode = rows[1:]
    ctx = [r[1] for r in decode]
    naive_fit = linear_fit(ctx, [r[2] for r in decode])
    cached_fit = linear_fit(ctx, [r[3] for r in decode])
    cum, t = [], 0.0
    for r in rows:
        t += r[2]
        cum.append(t)
    steps = [r[0] for r in rows]
    lin, quad = linear_fit(steps, cum), quadratic_fit(steps, cum)
    x = ratio(totals["naive"], totals["cached"])
    slopes = [round(100 * f.coef[1], 9) + 0.0 for f in (naive_fit, cached_fit)]  # no "-0"
    verdict = (f"measured {x:.1f}x (naive {totals['naive'] / 1e3:.2f} s vs cached "
               f"{totals['cached'] / 1e3:.2f} s, {prompt_len}-token prompt, {out_len} output "
               f"tokens) vs the claimed ~11x on an H100 (2,000 + 300 tokens); per decode step "
               f"{slopes[0]:+.3g} ms per 100 tokens without a cache, "
               f"{slopes[1]:+.3g} with one; naive total time fits a quadratic "
               f"R^2 {quad.r2:.4f} vs linear {lin.r2:.4f}")
    return Result(NAME, CLAIM, ["step", "context tokens", "naive ms", "cached ms"], rows,
                  verdict, x="context tokens", ys=["naive ms", "cached ms"])
