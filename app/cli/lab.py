"""`kvscope lab TRACE ...`: what-if replay of a request trace at several pool sizes and
eviction policies, with the Belady and infinite-cache ceilings (see kvscope.lab), for one
full-attention KV-cache group or the groups of `--groups` (a session: its own by default); with
`--host-blocks`, each what-if row again with a host tier of each size (hits per tier, blocks
moved, the sizing line; kvscope.lab.tiers)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvscope.app.cli import lab_billing, lab_routing
from kvscope.app.cli.common import positive_int
from kvscope.engine import policies as eviction_policies
from kvscope.lab import report, tiers
from kvscope.lab.residency import Residency, histograms, reuse_gaps, sizing_advice
from kvscope.lab.traces import FORMATS, TraceError
from kvscope.lab.whatif import GROUPS_SYNTAX, MODES, groups_spec, parse_groups
from kvscope.sessions.lab_input import load_lab_input


def add_parser(sub) -> None:
    p = sub.add_parser(
        "lab", help="what-if replay of a request trace: hit ratio per pool size and policy",
        description="Replay a Mooncake or Qwen-Bailian trace through kvscope's cache manager "
        "(no model) at each pool size and eviction policy; print one row per (policy, pool "
        "size) plus the infinite-cache ceiling. belady is the optimal ceiling at a size.")
    p.add_argument("trace", type=Path, metavar="TRACE")
    p.add_argument("--format", choices=(*FORMATS, "session"), default=None,
                   help="trace format (default: detected from the file)")
    p.add_argument("--block-size", type=positive_int, default=16,
                   help="tokens per block; must divide the trace's block (default 16)")
    p.add_argument("--pool-blocks", type=positive_int, nargs="+", default=None, metavar="N",
                   help="pool sizes in blocks (default: 1/32, 1/8 and 1/2 of the blocks an "
                   "infinite cache would hold)")
    p.add_argument("--policy", nargs="+", choices=report.lab_policies(), default=None,
                   help="eviction policies (default: lru belady; lru alone for groups without "
                   "full attention)")
    p.add_argument("--groups", default=None, metavar="GROUPS",
                   help=f"KV-cache groups sharing the pool, a hybrid model's: {GROUPS_SYNTAX} "
                   "(a hit is what every group accepts; a window group needs only the blocks "
                   "of the window before the hit point). Default: one full-attention group, "
                   "or a session's own groups")
    p.add_argument("--host-blocks", default=None, metavar="H[,H2...]",
                   help=f"host tier sizes behind the pool, comma-separated: {tiers.HOST_SYNTAX} "
                   "(a size with --kv-bytes-per-token). Each what-if "
                   "row is followed by one per host size (hits per tier, blocks offloaded and "
                   "loaded, the sizing line); one full-attention group only")
    p.add_argument("--host-policy", nargs="+", choices=eviction_policies.names(timed=False),
                   default=["lru"], help="the host tier's eviction policies (default lru)")
    p.add_argument("--kv-bytes-per-token", type=positive_int, default=None, metavar="BYTES",
                   help="the model's KV bytes per token (all layers, K and V): bytes moved "
                   "between the tiers and host sizes in GiB (else blocks only; a session "
                   "recorded with them: its model's, for the bytes moved)")
    p.add_argument("--mode", choices=MODES, default="sequential",
                   help="sequential: each request admitted then freed in order; timed: "
                   "arrivals at trace time, held output_length x TPOT (default sequential)")
    p.add_argument("--tpot-ms", type=float, default=30.0, help="timed mode: ms per output token")
    p.add_argument("--prefill-ms-per-token", type=float, default=0.0, metavar="MS",
                   help="timed mode: ms per prompt token computed (not served from the cache), "
                   "added to the time a request holds its blocks (default 0)")
    p.add_argument("--limit", type=positive_int, default=None, help="first N requests only")
    p.add_argument("--csv", type=Path, default=None, metavar="OUT.csv")
    p.add_argument("--png", type=Path, default=None, metavar="OUT.png",
                   help="the miss-ratio curves: LRU (one pass) and the ceilings; with "
                   "--host-blocks the curve per tier too (with --csv also OUT-tiers.csv)")
    p.add_argument("--residency", action="store_true",
                   help="lifetime, idle-before-evict and reuse-gap of the first replay, dead "
                   "cache over time and sizing advice (sequential mode); with --csv also "
                   "OUT-residency.csv")
    lab_routing.add_arguments(p)
    lab_billing.add_arguments(p)
    p.set_defaults(func=cmd_lab)


def cmd_lab(args: argparse.Namespace) -> int:
    try:
        return _lab(args)
    except (TraceError, OSError) as e:
        print(f"kvscope: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvscope lab: cancelled", file=sys.stderr)
        return 130


def _lab(args: argparse.Namespace) -> int:
    for name in ("tpot_ms", "prefill_ms_per_token"):
        if getattr(args, name) < 0:
            raise TraceError(f"--{name.replace('_', '-')} must be >= 0, got "
                             f"{getattr(args, name):g}")
    routers = lab_routing.check(args)
    prices = lab_billing.check(args)
    if args.residency and args.mode != "sequential":
        raise TraceError("--residency needs --mode sequential (time is counted in requests)")
    for out in (args.csv, args.png):
        if out is not None and not out.parent.is_dir():
            raise TraceError(f"{out}: folder {out.parent} does not exist")
    try:
        groups = parse_groups(args.groups) if args.groups is not None else None
    except ValueError as e:
        raise TraceError(f"--groups: {e}") from None
    per_block = args.kv_bytes_per_token and args.kv_bytes_per_token * args.block_size
    try:
        hosts = tiers.parse_host_sizes(args.host_blocks, per_block) \
            if args.host_blocks is not None else []
    except ValueError as e:
        raise TraceError(f"--host-blocks: {e}") from None
    trace = load_lab_input(args.trace, args.format, args.limit)
    trace.check_block_size(args.block_size)
    if not per_block and trace.kv_bytes_per_token:  # a session's model
        per_block = round(trace.kv_bytes_per_token * args.block_size)
    groups = trace.groups if groups is None else groups
    policies = args.policy
    if policies is None:
        policies = ["lru", "belady"] if any(g.window is None for g in groups) else ["lru"]
    try:
        report.check_policies(policies, groups)
    except ValueError as e:
        raise TraceError(f"--policy: {e}") from None
    print(f"{trace.name}: {len(trace.requests):,} requests ({trace.format}, "
          f"{trace.trace_block}-token trace blocks; ids after more than one predecessor: "
          f"{trace.num_unchained_ids:,}); block size {args.block_size}, {args.mode} mode")
    note = "" if report.one_full_group(groups) or "belady" not in policies else \
        "; belady is the full-attention group's ceiling"
    print(f"KV-cache groups: {' + '.join(g.name for g in groups)} ({groups_spec(groups)}){note}")
    if prices is not None:
        return lab_billing.run(args, trace, prices)
    sizes = args.pool_blocks
    if sizes is None:  # (every group holds its own copy of a block)
        from kvscope.lab import ceilings

        total = ceilings.distinct_blocks(ceilings.segment_stream(trace, args.block_size))
        total *= len(groups)
        split = args.replicas or 1  # routing: the fleet's total is the single pool's
        sizes = sorted({max(1, total // (32 * split)), max(1, total // (8 * split)),
                        max(1, total // (2 * split))})
    if routers is not None:
        return lab_routing.run(args, trace, routers, sizes, policies, groups)
    if hosts:
        moved = f"bytes moved ({per_block:,} a block)" if per_block else \
            "blocks moved (no --kv-bytes-per-token: blocks only)"
        print(f"host tiers: {', '.join(f'{h:,}' for h in hosts)} blocks "
              f"({', '.join(args.host_policy)}); {moved}")
    print(_header(bool(hosts)))
    probe = Residency(sample_every=max(1, len(trace.requests) // 50)) if args.residency else None
    rows, stream = report.run(trace, sizes, policies, args.block_size, args.mode,
                              args.tpot_ms / 1000, on_row=_row_printer(bool(hosts), per_block),
                              on_request=probe, groups=groups, host_sizes=hosts,
                              host_policies=args.host_policy,
                              prefill_s=args.prefill_ms_per_token / 1000)
    for r in rows:
        if r.host_blocks:
            print(tiers.sizing_line(r, per_block))
    if args.csv:
        report.write_csv(args.csv, rows, per_block)
        print(f"wrote {args.csv}")
    curve = report.lru_curve(stream, sizes, trace=trace, groups=groups) \
        if args.png or probe else None
    what_if = next((p for p in policies if p != "belady"), None)
    tier_curve = report.tier_curve(trace, args.block_size, sizes, hosts, what_if,
                                   args.host_policy[0], args.mode, args.tpot_ms / 1000,
                                   prefill_s=args.prefill_ms_per_token / 1000) \
        if hosts and what_if and (args.png or args.csv) else []
    if tier_curve and args.csv:
        out = args.csv.with_name(args.csv.stem + "-tiers.csv")
        report.write_csv(out, tier_curve, per_block)
        print(f"wrote {out} (the miss-ratio curve per tier: {what_if}, each host size)")
    if probe is not None:
        _print_residency(probe, stream, args, policies, sizes[0], curve,
                         rows[-1].token_hit_ratio)
    if args.png:
        from kvscope.app.plots.lab import write_curves_png  # Qt: only when a PNG is asked for

        write_curves_png(args.png, curve, rows, tier_curve)
        print(f"wrote {args.png}")
    return 0


def _header(tiered: bool) -> str:
    if not tiered:
        return (f"{'policy':>8} {'pool blocks':>12} {'token hit':>10} {'request hit':>11} "
                f"{'evicted':>11} {'blocks/s':>10} {'wall s':>7}")
    return (f"{'policy':>8} {'pool blocks':>12} {'host blocks':>12} {'token hit':>10} "
            f"{'device hit':>10} {'host hit':>9} {'request hit':>11} {'evicted':>11} "
            f"{'offloaded':>11} {'loaded':>9} {'host evict':>11} {'moved':>10} {'wall s':>7}")


def _row_printer(tiered: bool, bytes_per_block: int | None):
    """on_row for report.run: one table line per row (tier columns with host tiers)."""
    from kvscope.lab.capacity import format_bytes

    def show(r: report.Row) -> None:
        if not tiered:
            speed = f"{r.blocks_per_s:>10,.0f}" if r.blocks_per_s else f"{'':>10}"
            print(f"{r.policy:>8} {r.pool_blocks:>12,} {r.token_hit_ratio:>10.2%} "
                  f"{r.request_hit_ratio:>11.2%} {r.evicted_blocks:>11,} {speed} "
                  f"{r.wall_s:>7.1f}", flush=True)
            return
        moved = tiers.bytes_moved(r, bytes_per_block)
        moved = format_bytes(moved) if moved is not None else \
            f"{r.offloaded_blocks + r.loaded_blocks:,} bl"
        host = f"{r.host_blocks:,} {r.host_policy}" if r.host_blocks else "-"
        print(f"{r.policy:>8} {r.pool_blocks:>12,} {host:>12} {r.token_hit_ratio:>10.2%} "
              f"{r.device_hit_ratio:>10.2%} {r.host_hit_ratio:>9.2%} "
              f"{r.request_hit_ratio:>11.2%} {r.evicted_blocks:>11,} "
              f"{r.offloaded_blocks:>11,} {r.loaded_blocks:>9,} {r.host_evicted_blocks:>11,} "
              f"{moved:>10} {r.wall_s:>7.1f}", flush=True)

    return show


def _print_residency(probe: Residency, stream, args, policies, pool_blocks, curve,
                     ceiling) -> None:
    gaps = reuse_gaps(stream)
    policy = next((p for p in policies if p != "belady"), None)
    print(f"residency ({policy}, {pool_blocks:,} blocks; in requests):")
    for name in ("lifetime", "idle_before_evict"):
        p50, p90 = probe.percentile(name, 50), probe.percentile(name, 90)
        if p50 is not None:
            print(f"  {name:<18} p50 {p50:>9,.0f}  p90 {p90:>9,.0f}  "
                  f"({len(getattr(probe, name)):,} blocks evicted)")
    if gaps.blocks.sum():
        print(f"  {'reuse_gap':<18} p50 {gaps.percentile(50):>9,.0f}  p90 "
              f"{gaps.percentile(90):>9,.0f}  ({int(gaps.blocks.sum()):,} re-references, "
              "from the trace)")
    if probe.dead:
        peak = max(probe.dead, key=lambda d: d[1])
        print(f"  dead cache: peak {peak[1]:,} blocks at request {peak[0]:,}; "
              f"at the end {probe.dead[-1][1]:,}")
    print("  " + sizing_advice(probe, gaps, pool_blocks, curve, ceiling))
    if args.csv:
        out = args.csv.with_name(args.csv.stem + "-residency.csv")
        with open(out, "w", encoding="utf-8") as f:
            f.write("measure,low,high,blocks\n")
            f.writelines(f"{m},{lo},{hi},{n}\n" for m, lo, hi, n in histograms(probe, gaps))
            f.writelines(f"dead_blocks,{i},{i},{n}\n" for i, n in probe.dead)
        print(f"wrote {out}")
