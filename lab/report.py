"""One lab run as rows: a what-if replay per (policy, pool size), Belady's ceiling per size and
the infinite cache once, plus the LRU miss-ratio curve for plotting.

With KV-cache groups (a hybrid or sliding-window model: `groups`, by default the trace's) the
replays and the curve run with them. The infinite cache is the same for any groups (nothing is
ever evicted, so every group has every block it needs), holding each block once per group.
Belady stays the one full-attention group's optimum: still a ceiling when the groups include a
full-attention one (a request's hit is never longer than that group's), none without one (a
window needs only the blocks before the hit point), so it is refused then.

Host tiers (`host_sizes`, `host_policies`): each what-if row without a host tier is followed by
one per (host policy, host size) at the same device pool, carrying its hits per tier, blocks
moved and the hit ratio without the tier (the sizing line's baseline, lab.tiers). Belady and
the infinite cache stay one-tier rows. The CSV gains the tier columns only when a row has a
host tier."""

from __future__ import annotations

import csv
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvscope.engine import policies
from kvscope.engine.kv_groups import ONE_GROUP, KVGroup
from kvscope.lab import ceilings, tiers, whatif
from kvscope.lab.traces import Trace

CSV_COLUMNS = ("policy", "pool_blocks", "block_size", "mode", "token_hit_ratio",
               "request_hit_ratio", "evicted_blocks", "groups")
TIER_COLUMNS = ("host_blocks", "host_policy", "device_hit_ratio", "host_hit_ratio",
                "offloaded_blocks", "loaded_blocks", "host_evicted_blocks", "bytes_moved",
                "no_host_token_hit_ratio", "sizing")
GROUPS_CURVE_POINTS = 12  # pool sizes replayed for the curve of KV-cache groups
TIER_CURVE_POINTS = 8  # device pool sizes replayed per host size for the curve per tier


@dataclass
class Row:
    policy: str
    pool_blocks: int  # for "infinite": the distinct blocks an infinite cache ends up holding
    block_size: int
    mode: str
    token_hit_ratio: float
    request_hit_ratio: float
    evicted_blocks: int
    wall_s: float = 0.0
    blocks_per_s: float | None = None  # the manager's throughput (what-if replays)
    groups: str = "full"  # the KV-cache groups it ran with (whatif.groups_spec)
    host_blocks: int = 0  # 0: no host tier
    host_policy: str = ""
    host_hit_ratio: float = 0.0  # of token_hit_ratio, the tokens loaded from the host
    offloaded_blocks: int = 0
    loaded_blocks: int = 0
    host_evicted_blocks: int = 0
    no_host_hit_ratio: float | None = None  # with a host tier: the same pool without one

    @property
    def device_hit_ratio(self) -> float:
        return self.token_hit_ratio - self.host_hit_ratio

    def csv_values(self, tier_columns: bool = False, bytes_per_block: int | None = None
                   ) -> list:
        values = [self.policy, self.pool_blocks, self.block_size, self.mode,
                  f"{self.token_hit_ratio:.6f}",
                  f"{self.request_hit_ratio:.6f}", self.evicted_blocks, self.groups]
        if tier_columns:
            moved = tiers.bytes_moved(self, bytes_per_block)
            tiered = self.host_blocks > 0
            values += [self.host_blocks, self.host_policy, f"{self.device_hit_ratio:.6f}",
                       f"{self.host_hit_ratio:.6f}", self.offloaded_blocks, self.loaded_blocks,
                       self.host_evicted_blocks, "" if moved is None else moved,
                       f"{self.no_host_hit_ratio:.6f}" if tiered else "",
                       tiers.sizing_line(self, bytes_per_block) if tiered else ""]
        return values


def replay_row(r: whatif.WhatIfResult, no_host_hit_ratio: float | None = None) -> Row:
    """A what-if replay's row (`no_host_hit_ratio`: the same pool's without a host tier)."""
    return Row(r.policy, r.pool_blocks, r.block_size, r.mode, r.token_hit_ratio,
               r.request_hit_ratio, r.evicted_blocks, r.wall_s,
               r.num_blocks_processed / r.wall_s if r.wall_s else None,
               whatif.groups_spec(r.groups), r.host_blocks, r.host_policy if r.host_blocks else "",
               r.host_hit_ratio, r.offloaded_blocks, r.loaded_blocks, r.host_evicted_blocks,
               no_host_hit_ratio)


def lab_policies() -> tuple[str, ...]:
    """What the lab's miss-ratio runs can run: every eviction policy but the timed ones (ttl:
    `kvscope lab --ttl`, lab.billing), and Belady's ceiling."""
    return (*policies.names(timed=False), "belady")


def one_full_group(groups: tuple[KVGroup, ...]) -> bool:
    """One full-attention group: what the one-pass curve and a plain Belady model."""
    return len(groups) == 1 and groups[0].window is None


def check_policies(policies: list[str], groups: tuple[KVGroup, ...]) -> None:
    """ValueError for belady with groups of sliding windows only (it bounds nothing there)."""
    if "belady" in policies and all(g.window is not None for g in groups):
        raise ValueError(f"belady is the full-attention ceiling; the KV-cache groups "
                         f"{whatif.groups_spec(groups)} have no full-attention group (a window "
                         "needs only the blocks before the hit point): leave belady out")


def run(trace: Trace, pool_sizes: list[int], policies: list[str], block_size: int = 16,
        mode: str = "sequential", tpot_s: float = 0.03, on_row: Callable[[Row], None] = print,
        on_request=None, groups: tuple[KVGroup, ...] | None = None,
        host_sizes: tuple[int, ...] = (), host_policies: tuple[str, ...] = ("lru",),
        prefill_s: float = 0.0) -> tuple[list[Row], ceilings.SegmentStream]:
    """Rows in order: each policy at each size (then, what-if policies, that size with each
    host policy and host size), then the infinite cache. Belady and infinite are
    sequential-mode ceilings whatever `mode` is. on_request: see whatif.replay (first what-if
    run only). groups: the KV-cache groups (None: the trace's)."""
    groups = trace.groups if groups is None else groups
    check_policies(policies, groups)
    spec = whatif.groups_spec(groups)
    stream = ceilings.segment_stream(trace, block_size)
    hashes = None
    rows = []
    for policy in policies:
        for size in pool_sizes:
            if policy == "belady":
                start = time.perf_counter()
                c = ceilings.belady(stream, size)
                row = Row("belady", size, block_size, "sequential",
                          c.hit_tokens / stream.query_tokens,
                          c.requests_hit / len(stream.requests), c.evicted_blocks,
                          time.perf_counter() - start)
            else:
                hashes = hashes or whatif.block_hashes(trace, block_size)
                r = whatif.replay(trace, size, block_size, policy, mode, tpot_s, hashes,
                                  on_request, groups, prefill_s=prefill_s)
                on_request = None
                row = replay_row(r)
            rows.append(row)
            on_row(row)
            for host_policy in host_policies if policy != "belady" else ():
                for host in host_sizes:
                    r = whatif.replay(trace, size, block_size, policy, mode, tpot_s, hashes,
                                      groups=groups, host_blocks=host, host_policy=host_policy,
                                      prefill_s=prefill_s)
                    rows.append(replay_row(r, row.token_hit_ratio))
                    on_row(rows[-1])
    c = ceilings.infinite_cache(stream)
    row = Row("infinite", ceilings.distinct_blocks(stream) * len(groups), block_size,
              "sequential", c.hit_tokens / stream.query_tokens,
              c.requests_hit / len(stream.requests), 0, groups=spec)
    rows.append(row)
    on_row(row)
    return rows, stream


def lru_curve(stream: ceilings.SegmentStream, sizes: list[int], points: int = 48,
              trace: Trace | None = None, groups: tuple[KVGroup, ...] = ONE_GROUP
              ) -> list[tuple[int, float]]:
    """(pool blocks, LRU token hit ratio) from 1/64 of the infinite cache's size to all of it,
    log-spaced, plus `sizes`. One full-attention group: from one pass of stack distances;
    other groups (with the trace): an LRU what-if replay at each of GROUPS_CURVE_POINTS sizes
    (a hit then depends on what every group kept: no one pass gives it)."""
    one = one_full_group(groups)
    top = max(ceilings.distinct_blocks(stream) * len(groups), *sizes)
    n = points if one else min(points, GROUPS_CURVE_POINTS)
    grid = sorted({*np.unique(np.geomspace(max(1, top // 64), top, n).astype(int)).tolist(),
                   *sizes})
    if one:
        hits = ceilings.lru_hit_tokens(stream, grid)
    else:
        hashes = whatif.block_hashes(trace, stream.block_size)
        hits = [whatif.replay(trace, size, stream.block_size, hashes=hashes,
                              groups=groups).hit_tokens for size in grid]
    return [(n, h / stream.query_tokens) for n, h in zip(grid, hits, strict=True)]


def tier_curve(trace: Trace, block_size: int, sizes: list[int], host_sizes: list[int],
               policy: str = "lru", host_policy: str = "lru", mode: str = "sequential",
               tpot_s: float = 0.03, points: int = TIER_CURVE_POINTS, prefill_s: float = 0.0
               ) -> list[Row]:
    """The miss-ratio curve per tier: a what-if row per (host size, no tier first; device
    pool size), the sizes log-spaced from 1/64 of the infinite cache's blocks to all of it,
    plus `sizes`."""
    top = max(ceilings.distinct_blocks(ceilings.segment_stream(trace, block_size)), *sizes)
    grid = sorted({*np.unique(np.geomspace(max(1, top // 64), top, points).astype(int)).tolist(),
                   *sizes})
    hashes = whatif.block_hashes(trace, block_size)
    rows, base = [], {}
    for host in (0, *host_sizes):
        for size in grid:
            r = whatif.replay(trace, size, block_size, policy, mode, tpot_s, hashes,
                              host_blocks=host, host_policy=host_policy, prefill_s=prefill_s)
            rows.append(replay_row(r, base.get(size)))
            base.setdefault(size, r.token_hit_ratio)
    return rows


def write_csv(path, rows: list[Row], bytes_per_block: int | None = None) -> None:
    """The rows; with the tier columns when a row has a host tier (bytes_moved: empty without
    a bytes per block)."""
    tiered = any(r.host_blocks for r in rows)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS + TIER_COLUMNS if tiered else CSV_COLUMNS)
        w.writerows(r.csv_values(tiered, bytes_per_block) for r in rows)
