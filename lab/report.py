"""One lab run as rows: a what-if replay per (policy, pool size), Belady's ceiling per size and
the infinite cache once, plus the LRU miss-ratio curve for plotting."""

from __future__ import annotations

import csv
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvscope.engine import policies
from kvscope.lab import ceilings, whatif
from kvscope.lab.traces import Trace

CSV_COLUMNS = ("policy", "pool_blocks", "block_size", "mode", "token_hit_ratio",
               "request_hit_ratio", "evicted_blocks")


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

    def csv_values(self) -> list:
        return [self.policy, self.pool_blocks, self.block_size, self.mode,
                f"{self.token_hit_ratio:.6f}",
                f"{self.request_hit_ratio:.6f}", self.evicted_blocks]


def lab_policies() -> tuple[str, ...]:
    """What the lab can run: every eviction policy, and Belady's ceiling."""
    return (*policies.names(), "belady")


def run(trace: Trace, pool_sizes: list[int], policies: list[str], block_size: int = 16,
        mode: str = "sequential", tpot_s: float = 0.03, on_row: Callable[[Row], None] = print,
        on_request=None) -> tuple[list[Row], ceilings.SegmentStream]:
    """Rows in order: each policy at each size, then the infinite cache. Belady and infinite
    are sequential-mode ceilings whatever `mode` is. on_request: see whatif.replay (first
    what-if run only)."""
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
                                  on_request)
                on_request = None
                row = Row(policy, size, block_size, mode, r.token_hit_ratio,
                          r.request_hit_ratio, r.evicted_blocks, r.wall_s,
                          r.num_blocks_processed / r.wall_s if r.wall_s else None)
            rows.append(row)
            on_row(row)
    c = ceilings.infinite_cache(stream)
    row = Row("infinite", ceilings.distinct_blocks(stream), block_size, "sequential",
              c.hit_tokens / stream.query_tokens, c.requests_hit / len(stream.requests), 0)
    rows.append(row)
    on_row(row)
    return rows, stream


def lru_curve(stream: ceilings.SegmentStream, sizes: list[int], points: int = 48
              ) -> list[tuple[int, float]]:
    """(pool blocks, LRU token hit ratio) from 1/64 of the infinite cache's size to all of it,
    log-spaced, plus `sizes`."""
    top = max(ceilings.distinct_blocks(stream), *sizes)
    grid = sorted({*np.unique(np.geomspace(max(1, top // 64), top, points).astype(int)).tolist(),
                   *sizes})
    hits = ceilings.lru_hit_tokens(stream, grid)
    return [(n, h / stream.query_tokens) for n, h in zip(grid, hits, strict=True)]


def write_csv(path, rows: list[Row]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        w.writerows(r.csv_values() for r in rows)
