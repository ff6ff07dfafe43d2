"""The cache lab on the whole public Mooncake conversation trace (sequential mode, block size 16):
the manager's what-if replay (LRU) at each pool size, checked against the one-pass LRU curve and
an independent plain-dict LRU (tests/engine/plain_lru.py), with Belady's ceiling (must be >= LRU)
and the infinite cache. Prints the manager's throughput in blocks/s on the hash-id fast path,
against the same manager hashing token ids (the baseline, on the first --baseline-requests).

Run: .venv/bin/python benchmarks/lab_replay.py [--sizes 20000 100000 400000] [--limit N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvscope.engine import KVCacheManager
from kvscope.lab import ceilings, whatif
from kvscope.lab.traces import load_trace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "engine"))
from plain_lru import plain_lru_hit_ratio  # noqa: E402

DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"
BS = 16


def token_hashing_blocks_per_s(trace, pool_blocks: int, n: int) -> float:
    """The baseline: the same sequential replay, prompts given as token ids (hashed by the
    manager); each trace id stands for a run of 512 token ids derived from its node."""
    mgr = KVCacheManager(pool_blocks, BS, record_events=False)
    blocks = 0
    start = time.perf_counter()
    for i, r in enumerate(trace.requests[:n]):
        tokens = [t for node in r.nodes for t in range(node * 512, node * 512 + 512)]
        tokens = tokens[: r.input_length]
        if -(-len(tokens) // BS) > pool_blocks or not tokens:
            continue
        cached = mgr.admit(i, tokens, count_stats=False)
        mgr.free(i)
        blocks += len(tokens) // BS + -(-(len(tokens) - cached) // BS)
    return blocks / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--sizes", type=int, nargs="+", default=[20_000, 100_000, 400_000])
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--baseline-requests", type=int, default=300)
    args = ap.parse_args()
    start = time.perf_counter()
    trace = load_trace(args.trace, limit=args.limit)
    hashes = whatif.block_hashes(trace, BS)
    stream = ceilings.segment_stream(trace, BS)
    print(f"{trace.name}: {len(trace.requests):,} requests, {stream.query_tokens:,} prompt "
          f"tokens; loaded and prepared in {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    curve = ceilings.lru_hit_tokens(stream, args.sizes)
    print(f"one-pass LRU curve at {len(args.sizes)} sizes: {time.perf_counter() - start:.1f} s")
    print(f"{'pool blocks':>12} {'manager':>8} {'one-pass':>8} {'plain':>8} {'belady':>8} "
          f"{'blocks/s':>10} {'replay s':>8}")
    speeds = []
    for size, one_pass in zip(args.sizes, curve, strict=True):
        r = whatif.replay(trace, size, BS, "lru", hashes=hashes)
        plain = plain_lru_hit_ratio(args.trace, size) if args.limit is None else float("nan")
        best = ceilings.belady(stream, size).hit_tokens / stream.query_tokens
        speeds.append(r.num_blocks_processed / r.wall_s)
        flag = "" if best >= r.token_hit_ratio else "  BELADY BELOW LRU"
        print(f"{size:>12,} {r.token_hit_ratio:>8.2%} {one_pass / stream.query_tokens:>8.2%} "
              f"{plain:>8.2%} {best:>8.2%} {speeds[-1]:>10,.0f} {r.wall_s:>8.1f}{flag}")
    inf = ceilings.infinite_cache(stream).hit_tokens / stream.query_tokens
    print(f"infinite cache: {inf:.2%} ({ceilings.distinct_blocks(stream):,} blocks)")
    base = token_hashing_blocks_per_s(trace, args.sizes[0], args.baseline_requests)
    fast = whatif.replay(trace.__class__(trace.name, trace.format, trace.trace_block,
                                         trace.requests[: args.baseline_requests], 0),
                         args.sizes[0], BS, "lru")
    fast_speed = fast.num_blocks_processed / fast.wall_s
    print(f"first {args.baseline_requests} requests at {args.sizes[0]:,} blocks: token hashing "
          f"{base:,.0f} blocks/s, hash-id fast path {fast_speed:,.0f} blocks/s "
          f"({fast_speed / base:.1f}x)")


if __name__ == "__main__":
    main()
