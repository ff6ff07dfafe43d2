"""The routing lab on the whole public Mooncake conversation trace: 5 routers x 4 replicas (block
size 16, LRU), each replica a real KVCacheManager pool. Prints per router the fleet's token hit
ratio, the imbalance and the replay's wall time, against the baseline measured in the same run:
one pool of the fleet's size replayed by the single-pool lab (its time: what the manager costs
for the same blocks; the ratio: what routing adds). With --plain, each router is checked against
the independent plain simulation (tests/engine/plain_routing.py; sequential mode only, slow).

Run: .venv/bin/python benchmarks/lab_routing.py [--pool-blocks 100000] [--mode timed] [--plain]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvscope.lab import routing, whatif
from kvscope.lab.traces import load_trace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "engine"))
from plain_routing import plain_routed_hit_ratio  # noqa: E402

DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"
BS = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--pool-blocks", type=int, default=100_000, help="per replica")
    ap.add_argument("--mode", choices=whatif.MODES, default="sequential")
    ap.add_argument("--prefill-ms-per-token", type=float, default=0.0)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--plain", action="store_true")
    args = ap.parse_args()
    total = time.perf_counter()
    cpu = time.process_time()
    trace = load_trace(args.trace, limit=args.limit)
    hashes = whatif.block_hashes(trace, BS)
    R, size = args.replicas, args.pool_blocks
    kw = dict(block_size=BS, mode=args.mode, hashes=hashes,
              prefill_s=args.prefill_ms_per_token / 1000)
    print(f"{trace.name}: {len(trace.requests):,} requests; {R} replicas of {size:,} blocks, "
          f"{args.mode} mode; loaded in {time.perf_counter() - total:.1f} s")
    one = routing.one_pool_replay(trace, R, size, **kw)
    print(f"baseline: one pool of {R * size:,} blocks {one.token_hit_ratio:.2%} in "
          f"{one.wall_s:.1f} s")
    print(f"{'router':>14} {'token hit':>10} {'gap pp':>7} {'requests':>9} {'tokens':>7} "
          f"{'wall s':>7} {'x one pool':>10} {'plain':>8}")
    results = []
    for router in routing.default_routers(BS):
        r = routing.route(trace, router, R, size, **kw)
        results.append(r)
        plain = f"{plain_routed_hit_ratio(args.trace, router, R, size, args.limit)[0]:.2%}" \
            if args.plain and args.mode == "sequential" else "-"
        print(f"{router:>14} {r.token_hit_ratio:>10.2%} "
              f"{100 * (r.token_hit_ratio - one.token_hit_ratio):>+7.1f} "
              f"{r.request_imbalance:>8.2f}x {r.token_imbalance:>6.2f}x {r.wall_s:>7.1f} "
              f"{r.wall_s / one.wall_s:>9.2f}x {plain:>8}", flush=True)
    routed = sum(r.wall_s for r in results)
    print(routing.verdict(results, one.token_hit_ratio))
    print(f"5 routers x {R} replicas: {routed:.1f} s of replays (median "
          f"{sorted(r.wall_s for r in results)[2]:.1f} s per router, "
          f"{routed / len(results) / one.wall_s:.2f}x the one-pool replay); whole run "
          f"{time.perf_counter() - total:.1f} s wall, {time.process_time() - cpu:.1f} s CPU")


if __name__ == "__main__":
    main()
