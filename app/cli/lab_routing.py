"""`kvscope lab TRACE --replicas R [--router ...]`: the routing what-if (kvscope.lab.routing):
per pool size and policy, a table of routers (fleet token hit, gap to one pool of R times the
size, load imbalance, each replica's hit), then the verdict line; --csv writes the table (a
fleet row and one per replica for each router), --png the miss-ratio curve per router (with
--csv its points in OUT-routing-curve.csv)."""

from __future__ import annotations

import argparse
import csv

from kvscope.lab import routing
from kvscope.lab.traces import Trace, TraceError


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("routing what-if (with --replicas)")
    g.add_argument("--replicas", type=int, default=None, metavar="R",
                   help="replay across R replicas, each its own pool of every --pool-blocks "
                   "size (default sizes: the single pool's split across them), under each "
                   "--router; compared with one pool of R times the size")
    g.add_argument("--router", default=None, metavar="ROUTERS",
                   help=f"comma-separated: {routing.ROUTER_SYNTAX} (default: all five, "
                   "hash on the first 1,024 tokens)")
    g.add_argument("--seed", type=int, default=0, help="the random router's seed (default 0)")
    g.add_argument("--load-cap", type=float, default=routing.DEFAULT_LOAD_CAP, metavar="C",
                   help="prefix-aware: a replica takes a request only while its requests are "
                   "fewer than ceil(C x (all + 1) / R) (bounded loads; default "
                   f"{routing.DEFAULT_LOAD_CAP:g})")


def check(args: argparse.Namespace) -> list[str] | None:
    """The routers to run (None without --replicas); TraceError for what does not go with it."""
    if args.replicas is None:
        if args.router is not None:
            raise TraceError("--router needs --replicas")
        return None
    if args.replicas < 1:
        raise TraceError(f"--replicas must be at least 1, got {args.replicas}")
    if args.load_cap < 1:
        raise TraceError(f"--load-cap must be >= 1, got {args.load_cap:g}")
    for option in ("host_blocks", "residency"):
        if getattr(args, option):
            raise TraceError(f"--{option.replace('_', '-')} with --replicas is not supported "
                             "yet")
    if args.router is None:
        return routing.default_routers(args.block_size)
    try:
        return routing.parse_routers(args.router)
    except ValueError as e:
        raise TraceError(f"--router: {e}") from None


def run(args: argparse.Namespace, trace: Trace, routers: list[str], sizes: list[int],
        policies: list[str], groups) -> int:
    policies = [p for p in policies if p != "belady"]
    if not policies:
        raise TraceError("--policy: routing needs an eviction policy (belady is a ceiling)")
    R = args.replicas
    kw = dict(block_size=args.block_size, mode=args.mode, tpot_s=args.tpot_ms / 1000,
              prefill_s=args.prefill_ms_per_token / 1000, groups=groups, seed=args.seed,
              load_cap=args.load_cap)
    rows = []
    for policy in policies:
        for size in sizes:
            print(f"routing: {R} replicas of {size:,} blocks each ({policy}, {args.mode} "
                  "mode); gap: to one pool of the fleet's size; requests, tokens: max / mean")
            one = routing.one_pool_replay(trace, R, size, policy=policy, **kw)
            print(f"{'router':>14} {'token hit':>10} {'gap':>9} {'requests':>9} "
                  f"{'tokens':>7} {'wall s':>7}  per replica token hit")
            print(f"{'one pool':>14} {one.token_hit_ratio:>10.2%} {'':>9} {'':>9} {'':>7} "
                  f"{one.wall_s:>7.1f}  ({R * size:,} blocks)")
            results = []
            for router in routers:
                r = routing.route(trace, router, R, size, policy=policy, **kw)
                results.append(r)
                gap = 100 * (r.token_hit_ratio - one.token_hit_ratio)
                print(f"{router:>14} {r.token_hit_ratio:>10.2%} {gap:>+6.1f} pp "
                      f"{r.request_imbalance:>8.2f}x {r.token_imbalance:>6.2f}x "
                      f"{r.wall_s:>7.1f}  "
                      + " ".join(f"{x.token_hit_ratio:.1%}" for x in r.replicas), flush=True)
                rows += routing.csv_rows(r, one.token_hit_ratio)
            print(routing.verdict(results, one.token_hit_ratio))
    if args.csv:
        write_rows(args.csv, routing.CSV_COLUMNS, rows)
        print(f"wrote {args.csv}")
    if args.png or args.csv:
        from kvscope.lab import ceilings

        top = -(-ceilings.distinct_blocks(ceilings.segment_stream(trace, args.block_size))
                * len(groups) // R)
        points = routing.curve(trace, routers, R, routing.curve_sizes(top, sizes),
                               policy=policies[0], **kw)
        if args.csv:
            out = args.csv.with_name(args.csv.stem + "-routing-curve.csv")
            write_rows(out, ("router", "pool_blocks_per_replica", "token_hit_ratio"),
                   [(name, n, f"{h:.6f}") for name, pts in points.items() for n, h in pts])
            print(f"wrote {out} (the miss-ratio curve per router: {policies[0]}, {R} replicas)")
        if args.png:
            from kvscope.app.plots.lab import write_routing_png  # Qt: only for a PNG

            write_routing_png(args.png, points, R)
            print(f"wrote {args.png}")
    return 0


def write_rows(path, header, rows) -> None:
    """A CSV file: the header, then the rows."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
