"""`kvscope lab TRACE ...`: what-if replay of a request trace at several pool sizes and
eviction policies, with the Belady and infinite-cache ceilings (see kvscope.lab), for one
full-attention KV-cache group or the groups of `--groups` (a session: its own by default)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvscope.app.cli.common import positive_int
from kvscope.lab import report
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
    p.add_argument("--mode", choices=MODES, default="sequential",
                   help="sequential: each request admitted then freed in order; timed: "
                   "arrivals at trace time, held output_length x TPOT (default sequential)")
    p.add_argument("--tpot-ms", type=float, default=30.0, help="timed mode: ms per output token")
    p.add_argument("--limit", type=positive_int, default=None, help="first N requests only")
    p.add_argument("--csv", type=Path, default=None, metavar="OUT.csv")
    p.add_argument("--png", type=Path, default=None, metavar="OUT.png",
                   help="the miss-ratio curves: LRU (one pass) and the ceilings")
    p.add_argument("--residency", action="store_true",
                   help="lifetime, idle-before-evict and reuse-gap of the first replay, dead "
                   "cache over time and sizing advice (sequential mode); with --csv also "
                   "OUT-residency.csv")
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
    if args.tpot_ms < 0:
        raise TraceError(f"--tpot-ms must be >= 0, got {args.tpot_ms:g}")
    if args.residency and args.mode != "sequential":
        raise TraceError("--residency needs --mode sequential (time is counted in requests)")
    for out in (args.csv, args.png):
        if out is not None and not out.parent.is_dir():
            raise TraceError(f"{out}: folder {out.parent} does not exist")
    try:
        groups = parse_groups(args.groups) if args.groups is not None else None
    except ValueError as e:
        raise TraceError(f"--groups: {e}") from None
    trace = load_lab_input(args.trace, args.format, args.limit)
    trace.check_block_size(args.block_size)
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
    sizes = args.pool_blocks
    if sizes is None:  # (every group holds its own copy of a block)
        from kvscope.lab import ceilings

        total = ceilings.distinct_blocks(ceilings.segment_stream(trace, args.block_size))
        total *= len(groups)
        sizes = sorted({max(1, total // 32), max(1, total // 8), max(1, total // 2)})
    print(f"{'policy':>8} {'pool blocks':>12} {'token hit':>10} {'request hit':>11} "
          f"{'evicted':>11} {'blocks/s':>10} {'wall s':>7}")
    probe = Residency(sample_every=max(1, len(trace.requests) // 50)) if args.residency else None
    rows, stream = report.run(trace, sizes, policies, args.block_size, args.mode,
                              args.tpot_ms / 1000, on_row=_print_row, on_request=probe,
                              groups=groups)
    if args.csv:
        report.write_csv(args.csv, rows)
        print(f"wrote {args.csv}")
    curve = report.lru_curve(stream, sizes, trace=trace, groups=groups) \
        if args.png or probe else None
    if probe is not None:
        _print_residency(probe, stream, args, policies, sizes[0], curve,
                         rows[-1].token_hit_ratio)
    if args.png:
        from kvscope.app.plots.lab import write_curves_png  # Qt: only when a PNG is asked for

        write_curves_png(args.png, curve, rows)
        print(f"wrote {args.png}")
    return 0


def _print_row(r: report.Row) -> None:
    speed = f"{r.blocks_per_s:>10,.0f}" if r.blocks_per_s else f"{'':>10}"
    print(f"{r.policy:>8} {r.pool_blocks:>12,} {r.token_hit_ratio:>10.2%} "
          f"{r.request_hit_ratio:>11.2%} {r.evicted_blocks:>11,} {speed} {r.wall_s:>7.1f}",
          flush=True)


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
