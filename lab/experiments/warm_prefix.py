"""warm-prefix: time to first token when a share of the prompt is already cached, against the
ideal line (the cold time less the cached share)."""

from __future__ import annotations

import statistics

from kvscope.lab.experiments.fit import ideal_warm, linear_fit, ratio
from kvscope.lab.experiments.result import Result

NAME = "warm-prefix"
CLAIM = ("A warm shared prefix cuts time to first token roughly by the cached fraction plus a "
         "fixed overhead: 95 ms -> 21 ms when most of the prompt is cached.")
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 0.9)
REPEATS = 3


def measure(bench, quick: bool = False) -> Result:
    prompt_len, out = (64, 2) if quick else (1024, 4)
    engine = bench.engine()
    bench.plan(len(FRACTIONS) * REPEATS * 2 + 1)
    bench.one(engine, bench.prompt(prompt_len, seed=0), out)  # warm-up run
    measured = []
    for f in FRACTIONS:
        shared = int(f * prompt_len)
        ttft, cached = [], []
        for k in range(REPEATS):
            engine.reset_prefix_cache()
            prefix = bench.prompt(shared, seed=100 + k)
            bench.one(engine, prefix + bench.prompt(prompt_len - shared, seed=200 + k), out)
            o = bench.one(engine, prefix + bench.prompt(prompt_len - shared, seed=300 + k), out)
            ttft.append(1e3 * o.metrics.ttft_s)
            cached.append(o.num_cached_tokens / prompt_len)
        measured.append((f, statistics.median(cached), statistics.median(ttft)))
    return summarize(measured)


def summarize(measured: list[tuple[float, float, float]]) -> Result:
    """measured: (shared fraction, cached fraction, TTFT ms); the first is the cold point."""
    cold = measured[0][2]
    rows = [[f, c, t, ideal_warm(cold, c)] for f, c, t in measured]
    fit = linear_fit([1 - r[1] for r in rows], [r[2] for r in rows])
    last = rows[-1]
    verdict = (f"TTFT fell from {cold:.3g} ms cold to {last[2]:.3g} ms with "
               f"{100 * last[1]:.0f} % cached ({ratio(cold, last[2]):.1f}x; the claim: 95 -> 21 "
               f"ms, 4.5x); the ideal line gives {last[3]:.3g} ms; fixed overhead (fit at 100 % "
               f"cached) {fit.coef[0]:.3g} ms, R^2 {fit.r2:.3f}")
    return Result(NAME, CLAIM, ["shared fraction", "cached fraction", "TTFT ms", "ideal ms"],
                  rows, verdict, x="cached fraction", ys=["TTFT ms", "ideal ms"])
