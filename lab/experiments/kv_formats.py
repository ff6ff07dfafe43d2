"""kv-formats: what each KV-cache format costs in accuracy and gives in capacity, on the loaded
model and a prompt set (the built-in passages, a workload file or a session with its text).

Per format, against a full-precision (float32) cache:
- the KL divergence KL(P_ref || P_format) of the next-token distributions, teacher-forced: both
  caches are fed the same tokens (the reference's greedy continuation), so every position sees
  the same context and differs only by what the cache stored; its mean and 99.9th percentile
  over all scored positions;
- top-1 agreement at those positions;
- the first position where the format's own greedy output departs from the reference's (each
  run free, on a real engine), over the prompts; "-" when none does;
- K's error apart from V's: the mean KL divergence with the format on K only (V kept in full
  precision), and on V only;
- per layer, the relative RMS error of the K and V the cache holds (whole blocks) against the
  reference's, as the run cached them: the mean over layers and the worst layer;
- bytes per token as the engine stores them (scales and zero points included), the capacity
  against a 16-bit cache and the tokens one GiB holds;
- the median decode step time of the free run.
fp8 scales (per tensor, or per head) are calibrated on the prompts' first pass (their |K| and |V|
maxima) before anything is stored. The 32-bit row is the check: its KL divergence must be 0 and
its agreement 100 %."""

from __future__ import annotations

import statistics

from kvscope.lab.experiments.fit import ratio
from kvscope.lab.experiments.result import Result

NAME = "kv-formats"
CLAIM = ("Fewer bits per KV value fit more tokens in the same memory; what they cost shows in "
         "the next-token distributions (KL divergence and top-1 agreement against a "
         "full-precision cache, teacher-forced over the same tokens).")
REFERENCE = "float32"
SIXTEEN_BIT = "bfloat16"
GIB = 2**30
COLUMNS = ["format", "bytes/token", "capacity x", "tokens/GiB", "KLD mean", "KLD p99.9",
           "top-1 %", "first divergence", "K-only KLD", "V-only KLD", "K err", "V err",
           "worst layer", "decode ms"]


def formats() -> list[str]:
    """Every format the engine accepts, the reference first (float16 left out: bfloat16 is the
    16-bit row)."""
    from kvscope.engine.config import KV_CACHE_DTYPES

    rest = [f for f in KV_CACHE_DTYPES if f not in ("auto", "float16", REFERENCE)]
    return [REFERENCE, *rest]


def measure(bench, quick: bool = False, names: list[str] | None = None) -> Result:
    from kvscope.lab.experiments.kv_sides import layer_errors

    count, length, out = (2, 16, 8) if quick else (8, 192, 48)
    prompts = bench.prompt_set(count, length)
    names = names or formats()
    bench.plan(4 * len(names) + 1)
    ref_outputs, _ = bench.run(bench.engine(kv_cache_dtype=REFERENCE), prompts, out)
    reference = [o.token_ids for o in ref_outputs]
    ref = bench.forced(REFERENCE, prompts, reference)
    ref_logprobs = log_softmax(ref.logits)
    lengths = [len(p) + len(c) - 1 for p, c in zip(prompts, reference, strict=True)]
    bytes16 = bench.kv_bytes_per_token(SIXTEEN_BIT)
    rows = []
    for name in names:
        kld = {}
        for sides in ("kv", "k", "v"):
            run = bench.forced(name, prompts, reference, sides)
            bench.advance()
            kld[sides], top1 = divergence(ref_logprobs, log_softmax(run.logits))
            if sides == "kv":
                errors, both_top1 = layer_errors(run, ref, lengths), top1
                nbytes = run.runner.kv_bytes_per_token  # as the engine stores them
        engine = bench.engine(kv_cache_dtype=name)
        if engine.runner.is_fp8:
            engine.runner.calibrate_kv_scales(prompts)
        outputs, records = bench.run(engine, prompts, out)
        worst = max(range(len(errors)), key=lambda i: sum(errors[i]))
        rows.append([name, nbytes, ratio(bytes16, nbytes), int(GIB // nbytes),
                     statistics.fmean(kld["kv"]), percentile(kld["kv"], 99.9),
                     100 * statistics.fmean(both_top1),
                     first_divergence(reference, [o.token_ids for o in outputs]),
                     statistics.fmean(kld["k"]), statistics.fmean(kld["v"]),
                     statistics.fmean(e[0] for e in errors),
                     statistics.fmean(e[1] for e in errors), f"L{worst}",
                     1e3 * median_decode_s(records)])
    return summarize(rows)


def log_softmax(logits: list) -> list:
    return [x.float().log_softmax(-1) for x in logits]


def divergence(ref: list, other: list) -> tuple[list[float], list[bool]]:
    """Per scored position (every prompt's rows): KL(ref || other) in nats, and whether the
    two argmaxes agree."""
    kld, top1 = [], []
    for a, b in zip(ref, other, strict=True):
        kld.extend((a.exp() * (a - b)).sum(-1).clamp(min=0).tolist())
        top1.extend((a.argmax(-1) == b.argmax(-1)).tolist())
    return kld, top1


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, linear between ranks (with fewer than 1000 values, p99.9 is near the
    maximum)."""
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def first_divergence(reference: list[list[int]], outputs: list[list[int]]) -> int | str:
    """The earliest output position where any prompt's tokens differ; "-" when none does."""
    firsts = [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
              for a, b in zip(reference, outputs, strict=True)]
    firsts = [f for f in firsts if f is not None]
    return min(firsts) if firsts else "-"


def median_decode_s(records) -> float:
    """Median forward time of the decode steps (first steps of the engine left out)."""
    times = [r.decode_s for r in records if r.decode_tokens and not r.prefill_tokens
             and not r.warmup]
    return statistics.median(times) if times else 0.0


def summarize(rows: list[list]) -> Result:
    parts = []
    for name, _, cap, _, kld, _, top1, *_ in rows:
        if name == REFERENCE:
            continue
        parts.append(f"{name}: KLD {kld:.2g}, top-1 {top1:.1f} %, {cap:.2g}x capacity")
    ref = next((r for r in rows if r[0] == REFERENCE), None)
    check = ("" if ref is None else
             f" ({REFERENCE}, the check: KLD {ref[4]:.2g}, top-1 {ref[6]:.1f} %)")
    verdict = "; ".join(parts) + check
    return Result(NAME, CLAIM, COLUMNS, rows, verdict, x="format", ys=["KLD mean"])
