"""block-size: a prefix hit is counted in whole blocks, so a partial last block is recomputed;
bigger blocks mean fewer hit tokens (and less per-block overhead)."""

from __future__ import annotations

import statistics

from kvscope.lab.experiments.result import Result

NAME = "block-size"
CLAIM = ("Block size trades hit granularity against overhead: only whole blocks are reused, so "
         "the partial last block of a shared prefix is recomputed.")
SIZES = (8, 16, 32, 64)


def ideal_hit_tokens(shared: int, block_size: int) -> int:
    """Tokens of a shared prefix a later request reuses: whole blocks only."""
    return shared // block_size * block_size


def measure(bench, quick: bool = False) -> Result:
    shared, suffix, n, out = (40, 8, 3, 2) if quick else (200, 40, 8, 8)
    prefix = bench.prompt(shared, seed=7)
    prompts = [prefix + bench.prompt(suffix, seed=i) for i in range(n)]
    bench.plan(len(SIZES) * n)
    rows = []
    for size in SIZES:
        engine = bench.engine(block_size=size, num_blocks=max(64, 4096 // size))
        outs, step_ms = [], []
        for p in prompts:  # one at a time: each later request can hit the first one's blocks
            (o,), records = bench.run(engine, [p], out)
            outs.append(o)
            step_ms += [1e3 * r.wall_s for r in records if r.batch_size]
        hits = sum(o.num_cached_tokens for o in outs[1:])
        rows.append([size, hits, (n - 1) * ideal_hit_tokens(shared, size),
                     statistics.median(1e3 * o.metrics.ttft_s for o in outs[1:]),
                     statistics.median(step_ms)])
    return summarize(rows, shared, n)


def summarize(rows, shared: int, n: int) -> Result:
    first, last = rows[0], rows[-1]
    verdict = (f"{n - 1} requests sharing a {shared}-token prefix reused {first[1]} tokens at "
               f"block size {first[0]} and {last[1]} at {last[0]} (whole blocks only: expected "
               f"{first[2]} and {last[2]}); median step {first[4]:.3g} ms vs {last[4]:.3g} ms")
    return Result(NAME, CLAIM, ["block size", "hit tokens", "whole-block hit tokens", "TTFT ms",
                                "median step ms"], rows, verdict, x="block size",
                  ys=["hit tokens", "whole-block hit tokens"])
