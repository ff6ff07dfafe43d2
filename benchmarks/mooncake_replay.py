"""Replay the public Mooncake conversation trace through the KV cache manager (no model).

Each request is admitted on arrival, holds its prompt and output blocks for output_length x TPOT,
then is freed (see kvscope.engine.trace_replay). Prints the token hit ratio at several pool sizes
next to the trace's infinite-cache ceiling (36.6 %, from the trace's README, counted in 512-token
blocks), and the manager's operations per second over the whole trace.

Run: .venv/bin/python benchmarks/mooncake_replay.py [--pools 16384 65536 262144] [--limit N]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvscope.engine import KVCacheManager
from kvscope.engine.trace_replay import load_mooncake, replay

DEFAULT_TRACE = (Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake"
                 / "conversation_trace.jsonl")
CEILING = 0.366


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--pools", type=int, nargs="+", default=[16_384, 65_536, 262_144])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tpot-ms", type=float, default=30.0)
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args()
    requests = load_mooncake(args.trace, args.limit)
    tokens = sum(r.input_length for r in requests)
    print(f"{args.trace.name}: {len(requests):,} requests, {tokens:,} prompt tokens; "
          f"block size {args.block_size}, TPOT {args.tpot_ms:g} ms")
    print(f"{'pool blocks':>12} {'pool tokens':>12} {'token hit':>10} {'of ceiling':>10} "
          f"{'evicted':>11} {'rejected':>8} {'ops/s':>9} {'blocks/s':>11} {'wall s':>7}")
    for n in args.pools:
        mgr = KVCacheManager(n, args.block_size, record_events=False)
        start = time.perf_counter()
        res = replay(mgr, requests, args.tpot_ms / 1000)
        wall = time.perf_counter() - start
        blocks = (res.query_tokens + sum(r.output_length for r in requests)) / args.block_size
        print(f"{n:>12,} {n * args.block_size:>12,} {res.token_hit_ratio:>9.1%} "
              f"{res.token_hit_ratio / CEILING:>9.0%} {res.num_evicted_blocks:>11,} "
              f"{res.num_rejected:>8} {res.num_operations / wall:>9,.0f} {blocks / wall:>11,.0f} "
              f"{wall:>7.1f}")
    print(f"infinite-cache ceiling (trace README, 512-token blocks): {CEILING:.1%}")


if __name__ == "__main__":
    main()
