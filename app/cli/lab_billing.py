"""`kvscope lab TRACE --ttl S [...]`: prompt caching as an API bills it (kvscope.lab.billing):
per TTL (and pool size, when given: a capacity too) the cost with and without caching, the
tokens written, read and uncached, the hit ratio by tokens and by requests; the prefixes that
cost or saved most (writes, hits, whether they paid); the verdict line. --csv writes the runs
(and OUT-prefixes.csv), --png the cost against TTL from 1 min to 2 h."""

from __future__ import annotations

import argparse
import dataclasses

from kvscope.app.cli.lab_routing import write_rows
from kvscope.lab import billing
from kvscope.lab.traces import Trace, TraceError

PRICE_OPTIONS = (("input_price", "input", "$ per million input tokens (C)"),
                 ("write_mult", "write", "a cache write costs this times C (w)"),
                 ("read_mult", "read", "a cache read costs this times C (r)"),
                 ("min_cache_tokens", "min_tokens", "the shortest prompt prefix cached"),
                 ("output_price", "output", "$ per million output tokens"))
CSV_COLUMNS = ("ttl_s", "pool_blocks", "mode", "cost", "cost_without_cache", "saving",
               "written_tokens", "read_tokens", "uncached_tokens", "output_tokens",
               "token_hit_ratio", "request_hit_ratio", "expired_blocks", "evicted_blocks")
TOP_PREFIXES = 10


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prompt-cache billing (with --ttl)")
    g.add_argument("--ttl", type=float, nargs="+", default=None, metavar="S",
                   help="bill the trace under the ttl policy: a cached block expires S seconds "
                   "after its last use (the trace's clock); one run per TTL (with "
                   "--pool-blocks, per size too: a capacity; default: none)")
    g.add_argument("--prices", choices=billing.PRESETS, default="anthropic-5m",
                   help=f"the prices the options below start from ({billing.PRESETS_SOURCE}; "
                   "default anthropic-5m: $3 / $15 per million, w 1.25, r 0.1, 1,024 tokens)")
    for dest, _, text in PRICE_OPTIONS:
        g.add_argument(f"--{dest.replace('_', '-')}", dest=dest,
                       type=int if dest == "min_cache_tokens" else float, default=None,
                       help=text + " (default: the preset's)")


def check(args: argparse.Namespace) -> billing.Prices | None:
    """The prices (None without --ttl); TraceError for what does not go with it."""
    if args.ttl is None:
        return None
    for option in ("replicas", "host_blocks", "residency"):
        if getattr(args, option):
            raise TraceError(f"--{option.replace('_', '-')} with --ttl is not supported")
    if min(args.ttl) <= 0:
        raise TraceError(f"--ttl must be > 0 seconds, got {min(args.ttl):g}")
    prices = dataclasses.replace(billing.PRESETS[args.prices][0], **{
        field: getattr(args, dest) for dest, field, _ in PRICE_OPTIONS
        if getattr(args, dest) is not None})
    problem = prices.problem()
    if problem:
        raise TraceError(problem)
    return prices


def run(args: argparse.Namespace, trace: Trace, prices: billing.Prices) -> int:
    p = prices
    print(f"prompt-cache billing (ttl policy, {args.mode} mode): input ${p.input:g} per "
          f"million, write {p.write:g}x, read {p.read:g}x, from {p.min_tokens:,} tokens, output "
          f"${p.output:g} per million (from --prices {args.prices}: {billing.PRESETS_SOURCE}); "
          f"a prefix pays with more than {p.break_even:.2f} hits per write")
    kw = dict(block_size=args.block_size, mode=args.mode, tpot_s=args.tpot_ms / 1000,
              prefill_s=args.prefill_ms_per_token / 1000)
    kw["hashes"] = billing.whatif.block_hashes(trace, args.block_size)
    print(f"{'TTL s':>8} {'pool blocks':>12} {'cost $':>10} {'no cache $':>10} {'saving':>8} "
          f"{'written':>12} {'read':>12} {'uncached':>12} {'token hit':>9} {'request hit':>11} "
          f"{'expired':>9}")
    bills = []
    for ttl in args.ttl:
        for size in args.pool_blocks or [None]:
            b = billing.run(trace, ttl, prices, pool_blocks=size, **kw)
            bills.append(b)
            pool = f"{size:,}" if size else "unlimited"
            print(f"{ttl:>8,.0f} {pool:>12} {b.cost:>10,.4f} {b.cost_without_cache:>10,.4f} "
                  f"{b.saving:>8.1%} {b.written_tokens:>12,} {b.read_tokens:>12,} "
                  f"{b.uncached_tokens:>12,} {b.token_hit_ratio:>9.2%} "
                  f"{b.request_hit_ratio:>11.2%} {b.expired_blocks:>9,}", flush=True)
    first = bills[0]
    print(f"prefixes at TTL {first.ttl_s:,.0f} s (runs of blocks from the root; the "
          f"{TOP_PREFIXES} that cost or saved most, of {len(first.prefixes):,}):")
    print(f"{'tokens':>17} {'writes':>7} {'hits':>7} {'paid':>5} {'saving $':>10}  first request")
    for x in sorted(first.prefixes, key=lambda x: -abs(x.saving(p)))[:TOP_PREFIXES]:
        print(f"{f'{x.start_token:,}-{x.end_token:,}':>17} {x.writes:>7,} {x.hits:>7,} "
              f"{'yes' if x.paid(p) else 'no':>5} {x.saving(p):>10,.4f}  {x.first_request}")
    for b in bills:
        print(billing.verdict(b))
    if args.csv:
        write_rows(args.csv, CSV_COLUMNS, [_csv_row(b, args.mode) for b in bills])
        out = args.csv.with_name(args.csv.stem + "-prefixes.csv")
        write_rows(out, ("ttl_s", "pool_blocks", "start_token", "end_token", "writes", "hits",
                     "break_even_hits", "paid", "saving", "first_request"),
               [(b.ttl_s, b.pool_blocks, x.start_token, x.end_token, x.writes, x.hits,
                 f"{p.break_even:.6f}", x.paid(p), f"{x.saving(p):.6f}", x.first_request)
                for b in bills for x in b.prefixes])
        print(f"wrote {args.csv} and {out}")
    if args.png:
        from kvscope.app.plots.billing import write_cost_png  # Qt: only for a PNG

        ttls = sorted({*billing.TTL_GRID_S, *args.ttl})
        points = billing.cost_curve(trace, prices, ttls, **kw)
        write_cost_png(args.png, points, first.cost_without_cache)
        print(f"wrote {args.png} (cost against TTL, {ttls[0]:g} to {ttls[-1]:g} s)")
    return 0


def _csv_row(b: billing.Bill, mode: str) -> list:
    return [b.ttl_s, b.pool_blocks, mode, f"{b.cost:.6f}", f"{b.cost_without_cache:.6f}",
            f"{b.saving:.6f}", b.written_tokens, b.read_tokens, b.uncached_tokens,
            b.output_tokens, f"{b.token_hit_ratio:.6f}", f"{b.request_hit_ratio:.6f}",
            b.expired_blocks, b.evicted_blocks]
