"""warm-up: the first requests of a fresh engine are slower; how many until the time settles
within 5 % of the median."""

from __future__ import annotations

import statistics

from kvscope.lab.experiments.fit import ratio, settled_after
from kvscope.lab.experiments.result import Result

NAME = "warm-up"
CLAIM = ("The first measurement lies: a fresh engine's first requests are slower (allocations, "
         "kernel selection, caches); benchmarks discard a warm-up.")
TOLERANCE = 0.05


def measure(bench, quick: bool = False) -> Result:
    n, prompt_len, out = (6, 16, 4) if quick else (20, 128, 16)
    bench.plan(n)
    engine = bench.engine(enable_prefix_caching=False)
    rows = []
    for i in range(n):
        o = bench.one(engine, bench.prompt(prompt_len, seed=i), out)
        rows.append([i + 1, 1e3 * o.metrics.ttft_s, 1e3 * o.metrics.e2e_s])
    return summarize(rows)


def summarize(rows) -> Result:
    """rows: [request number, TTFT ms, total ms]."""
    totals = [r[2] for r in rows]
    med = statistics.median(totals)
    k = settled_after(totals, TOLERANCE)
    settled = (f"settled within {100 * TOLERANCE:.0f} % of the median after {k} requests"
               if k is not None else
               f"never settled within {100 * TOLERANCE:.0f} % of the median for 3 requests "
               f"running (a noisy machine?)")
    verdict = (f"the first request took {totals[0]:.3g} ms, {ratio(totals[0], med):.1f}x the "
               f"median {med:.3g} ms; {settled}")
    return Result(NAME, CLAIM, ["request", "TTFT ms", "total ms"], rows, verdict, x="request",
                  ys=["total ms", "TTFT ms"])
