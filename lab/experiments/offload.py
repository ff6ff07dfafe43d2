"""offload: time to first token of a prompt whose prefix is recomputed, found on the device, or
found on the host tier only (evicted there, loaded back), across prefix lengths; and the
shortest prefix from which loading it back beats recomputing it on this machine.

Each length gets an engine whose device pool holds exactly one prompt and a host tier behind
it. One cycle per repeat, all on the same prompt (a fresh prefix, the same short suffix):
  recompute  the device cache dropped (no offload: a reset copies nothing), a cold prefill;
  device     the same prompt again: its prefix's blocks hit on the device;
  host       a filler prompt of the same length takes the whole pool, so the prefix's blocks
             are evicted to the host; the device cache is dropped again (so the measured step
             evicts, and offloads, nothing); the same prompt hits on the host and its blocks
             are loaded back in its first step (the step records' transfer_s).
The first cycle of each length is a warm-up and is not counted; each time is the median."""

from __future__ import annotations

import statistics

from kvscope.lab.experiments.result import Result

NAME = "offload"
CLAIM = ("A prefix kept on the host tier is loaded back faster than it is recomputed once it "
         "is long enough: recomputing grows with the prefix's compute, loading with its bytes.")
BLOCK = 16
SUFFIX = 8  # under one block: the prompt's whole blocks are the prefix's
LONGEST = 8192  # full mode stops here (or at the model's context, if shorter)
COLUMNS = ["prefix tokens", "recompute hit tokens", "device hit tokens", "host hit tokens",
           "recompute ms", "device ms", "host ms", "load ms"]


def prefix_lengths(context: int, quick: bool) -> list[int]:
    """Quick: three short ones. Full: powers of two from one block up to the longest
    whole-block prefix that leaves room for the suffix in the context (capped at LONGEST), and
    that one."""
    if quick:
        return [32, 64, 128]
    top = min(LONGEST, (context - SUFFIX) // BLOCK * BLOCK)
    out, n = [], BLOCK
    while n < top:
        out.append(n)
        n *= 2
    return [*out, top]


def measure(bench, quick: bool = False) -> Result:
    repeats = 3 if quick else 5
    lengths = prefix_lengths(bench.model_config.max_position_embeddings, quick)
    suffix = bench.prompt(SUFFIX, seed=1)
    bench.plan(len(lengths) * (repeats + 1) * 4)
    rows = []
    for n in lengths:
        pool = -(-(n + SUFFIX) // BLOCK)
        engine = bench.engine(block_size=BLOCK, num_blocks=pool, host_blocks=2 * pool)
        cycles = [cycle(bench, engine, bench.prompt(n, seed=1000 * n + k) + suffix,
                        bench.prompt(n + SUFFIX, seed=1000 * n + 500 + k))
                  for k in range(repeats + 1)][1:]  # the first: warm-up
        rows.append([n, *(statistics.median(c[i] for c in cycles) for i in range(7))])
    return summarize(rows, bench.device)


def cycle(bench, engine, prompt: list[int], filler: list[int]) -> list[float]:
    """One repeat: [hit tokens recompute, device, host, TTFT ms recompute, device, host,
    load ms]."""
    engine.reset_prefix_cache()
    cold = bench.one(engine, prompt, 1)
    warm = bench.one(engine, prompt, 1)
    bench.one(engine, filler, 1)  # takes the whole pool: the prefix goes to the host
    engine.reset_prefix_cache()  # the filler's blocks: dropped, not offloaded
    (host,), records = bench.run(engine, [prompt], 1)
    return [cold.num_cached_tokens, warm.num_cached_tokens, host.metrics.host_cached_tokens,
            *(1e3 * o.metrics.ttft_s for o in (cold, warm, host)),
            1e3 * sum(r.transfer_s for r in records)]


def crossing(lengths: list[int], recompute: list[float], host: list[float]) -> int | None:
    """The shortest length from which on loading from the host beats recomputing at every
    longer length measured (a single noisy win below a loss is not a crossing); None when
    recomputing is as fast or faster at the longest."""
    found = None
    for n, r, h in reversed(list(zip(lengths, recompute, host, strict=True))):
        if h >= r:
            break
        found = n
    return found


def summarize(rows: list[list[float]], device: str = "cpu") -> Result:
    """rows: COLUMNS, one per prefix length, shortest first."""
    result = Result(NAME, CLAIM, COLUMNS, rows, "", x="prefix tokens",
                    ys=["recompute ms", "device ms", "host ms", "load ms"])
    lengths, cold, warm, host, load = (result.column(c) for c in (
        "prefix tokens", "recompute ms", "device ms", "host ms", "load ms"))
    at = crossing(lengths, cold, host)
    if at is None:
        head = (f"on this machine ({device}), no crossing in the range measured "
                f"({lengths[0]}-{lengths[-1]} tokens): recomputing the prefix stayed as fast as "
                f"loading it back from the host tier")
    else:
        i = lengths.index(at)
        first = " (the shortest measured)" if i == 0 else ""
        head = (f"on this machine ({device}), loading a prefix of >= {at} tokens{first} back "
                f"from the host tier is faster than recomputing it: {host[i]:.3g} ms vs "
                f"{cold[i]:.3g} ms at {at}")
    result.verdict = (f"{head}; at {lengths[-1]} tokens: recompute {cold[-1]:.3g} ms, host "
                      f"{host[-1]:.3g} ms (load {load[-1]:.3g} ms), device {warm[-1]:.3g} ms")
    return result
