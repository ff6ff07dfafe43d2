"""Micro-benchmark of the KV cache manager (no model).

Reports, as medians over repeats:
  - admit + free operations per second for 2,000-token requests: cold (every block hashed and
    stored), warm (a full prefix hit), and with prefix caching off (the baseline: no hashing);
  - the time to take a snapshot of a 16,384-block pool holding 256 requests.

Run: .venv/bin/python benchmarks/cache_manager.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvscope.engine import KVCacheManager

PROMPT = 2000
BLOCK = 16


def ops_per_second(caching: bool, warm: bool, n: int) -> float:
    mgr = KVCacheManager(16_384, BLOCK, enable_prefix_caching=caching, record_events=False)
    rng = random.Random(0)
    shared = [rng.randrange(32000) for _ in range(PROMPT)]
    prompts = [shared if warm else [rng.randrange(32000) for _ in range(PROMPT)]
               for _ in range(n)]
    if warm:
        mgr.admit(-1, shared)
        mgr.free(-1)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        mgr.admit(i, p)
        mgr.free(i)
    return 2 * n / (time.perf_counter() - start)


def snapshot_seconds() -> float:
    mgr = KVCacheManager(16_384, BLOCK, record_events=False)
    rng = random.Random(1)
    system = [rng.randrange(32000) for _ in range(512)]
    for i in range(256):  # a shared system prompt plus a private part: shared and active blocks
        mgr.admit(i, system + [rng.randrange(32000) for _ in range(rng.randrange(16, 400))])
    for i in range(0, 256, 3):
        mgr.free(i)  # some cached blocks too
    start = time.perf_counter()
    mgr.snapshot()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--requests", type=int, default=500)
    args = ap.parse_args()
    med = lambda f: statistics.median(f() for _ in range(args.repeats))  # noqa: E731
    base = med(lambda: ops_per_second(False, False, args.requests))
    cold = med(lambda: ops_per_second(True, False, args.requests))
    warm = med(lambda: ops_per_second(True, True, args.requests))
    snap = med(snapshot_seconds)
    print(f"admit+free, {PROMPT}-token requests, block size {BLOCK} "
          f"(median of {args.repeats}, {args.requests} requests each):")
    print(f"  prefix caching off (baseline) {base:12,.0f} ops/s   1.00x")
    print(f"  cold: hash + store every block {cold:11,.0f} ops/s   {cold / base:.2f}x")
    print(f"  warm: full prefix hit          {warm:11,.0f} ops/s   {warm / base:.2f}x")
    print(f"snapshot of a 16,384-block pool with 256 requests: {snap * 1e3:.2f} ms (median)")


if __name__ == "__main__":
    main()
