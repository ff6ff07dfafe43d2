"""prompt-length and output-length: prompt length lands on time to first token, output length
lands on total time, time per output token stays flat."""

from __future__ import annotations

import statistics

from kvscope.lab.experiments.fit import linear_fit, spread
from kvscope.lab.experiments.result import Result

PROMPT = "prompt-length"
PROMPT_CLAIM = ("Prompt length lands on time to first token (prefill grows with it); time per "
                "output token stays flat.")
OUTPUT = "output-length"
OUTPUT_CLAIM = ("Output length lands on total time, linearly (one decode step per token); time "
                "to first token stays flat.")
REPEATS = 3


def _sweep(bench, engine, prompt_lens, out_lens):
    """Median TTFT, TPOT and end-to-end ms over REPEATS distinct prompts per point."""
    rows = []
    for p, o in zip(prompt_lens, out_lens, strict=True):
        outs = [bench.one(engine, bench.prompt(p, seed=1000 * p + o + k), o)
                for k in range(REPEATS)]
        med = [statistics.median(1e3 * getattr(x.metrics, f) for x in outs)
               for f in ("ttft_s", "tpot_s", "e2e_s")]
        rows.append([p, o, *med])
    return rows


COLUMNS = ["prompt tokens", "output tokens", "TTFT ms", "TPOT ms", "total ms"]


def measure_prompt(bench, quick: bool = False) -> Result:
    lens = [16, 32, 64] if quick else [64, 128, 256, 512, 1024]
    out = 4 if quick else 16
    bench.plan(len(lens) * REPEATS + 1)
    engine = bench.engine(enable_prefix_caching=False)
    bench.one(engine, bench.prompt(lens[0], seed=0), out)  # the first run lies (see warm-up)
    return summarize_prompt(_sweep(bench, engine, lens, [out] * len(lens)))


def summarize_prompt(rows) -> Result:
    fit = linear_fit([r[0] for r in rows], [r[2] for r in rows])
    tpot = [r[3] for r in rows]
    verdict = (f"TTFT grows {1000 * fit.coef[1]:.3g} ms per 1,000 prompt tokens (linear fit R^2 "
               f"{fit.r2:.3f}, {rows[0][2]:.3g} ms at {rows[0][0]} to {rows[-1][2]:.3g} ms at "
               f"{rows[-1][0]} tokens); TPOT stays within {100 * spread(tpot):.0f} % of its "
               f"median {statistics.median(tpot):.3g} ms")
    return Result(PROMPT, PROMPT_CLAIM, COLUMNS, rows, verdict, x="prompt tokens",
                  ys=["TTFT ms", "TPOT ms"])


def measure_output(bench, quick: bool = False) -> Result:
    lens = [4, 8, 16] if quick else [16, 32, 64, 128, 256]
    prompt = 16 if quick else 64
    bench.plan(len(lens) * REPEATS + 1)
    engine = bench.engine(enable_prefix_caching=False)
    bench.one(engine, bench.prompt(prompt, seed=0), lens[0])
    return summarize_output(_sweep(bench, engine, [prompt] * len(lens), lens))


def summarize_output(rows) -> Result:
    fit = linear_fit([r[1] for r in rows], [r[4] for r in rows])
    ttft = [r[2] for r in rows]
    verdict = (f"total time grows {fit.coef[1]:.3g} ms per output token (linear fit R^2 "
               f"{fit.r2:.3f}, {rows[0][4]:.3g} ms for {rows[0][1]} to {rows[-1][4]:.3g} ms for "
               f"{rows[-1][1]} tokens); TTFT stays within {100 * spread(ttft):.0f} % of its "
               f"median {statistics.median(ttft):.3g} ms")
    return Result(OUTPUT, OUTPUT_CLAIM, COLUMNS, rows, verdict, x="output tokens",
                  ys=["total ms", "TTFT ms"])
