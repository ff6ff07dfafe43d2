"""Residency analytics (sequential mode; time is counted in requests). From one what-if replay,
per evicted block: lifetime (hash stored -> evicted) and idle time before eviction (last hit or
store -> evicted), plus the dead cache (resident but unreachable blocks) sampled along the run.
From the trace itself: the reuse gap, between consecutive references to the same block, hit or
not (the hits alone would only show the gaps the pool already covers)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvscope.engine import events as ev
from kvscope.engine.dead import dead_blocks_in_pool
from kvscope.lab.ceilings import SegmentStream


@dataclass
class Residency:
    sample_every: int = 0  # requests between dead-cache samples; 0: none
    lifetime: list[int] = field(default_factory=list)
    idle_before_evict: list[int] = field(default_factory=list)
    dead: list[tuple[int, int]] = field(default_factory=list)  # (request, dead blocks)
    _stored: dict[int, int] = field(default_factory=dict)
    _last: dict[int, int] = field(default_factory=dict)

    def __call__(self, mgr, i: int) -> None:
        """The on_request observer of whatif.replay (needs the manager's events)."""
        for e in mgr.events.drain():
            if e.kind == ev.CACHED:
                for b in e.blocks:
                    self._stored[b] = self._last[b] = i
            elif e.kind == ev.CACHE_HIT:
                for b in e.blocks:
                    self._last[b] = i
            elif e.kind == ev.EVICTED:
                for b in e.blocks:
                    self.lifetime.append(i - self._stored.pop(b))
                    self.idle_before_evict.append(i - self._last.pop(b))
        if self.sample_every and i % self.sample_every == 0:
            self.dead.append((i, int(dead_blocks_in_pool(mgr.pool, mgr.groups).sum())))

    def percentile(self, name: str, q: float) -> float | None:
        values = getattr(self, name)
        return float(np.percentile(values, q)) if values else None


@dataclass
class ReuseGaps:
    gaps: np.ndarray  # requests between two references to a block
    blocks: np.ndarray  # how many blocks had that gap at that reference

    def percentile(self, q: float) -> float | None:
        if not self.blocks.sum():
            return None
        order = np.argsort(self.gaps, kind="stable")
        cum = np.cumsum(self.blocks[order])
        return float(self.gaps[order][np.searchsorted(cum, q / 100 * cum[-1])])


def reuse_gaps(stream: SegmentStream) -> ReuseGaps:
    """Every re-reference of a hittable block in the trace, whatever the pool did."""
    last: dict[int, int] = {}
    gaps, blocks = [], []
    for i, refs in enumerate(stream.requests):
        for s, _, h in refs:
            j = last.get(s)
            if j is not None and h:
                gaps.append(i - j)
                blocks.append(h)
            last[s] = i
    return ReuseGaps(np.array(gaps, dtype=np.int64), np.array(blocks, dtype=np.int64))


def histograms(res: Residency, gaps: ReuseGaps) -> list[tuple[str, int, int, int]]:
    """(measure, bin low, bin high, blocks) in power-of-two bins of requests."""
    rows = []
    measures = [(name, np.asarray(getattr(res, name), dtype=np.int64), None)
                for name in ("lifetime", "idle_before_evict")]
    for name, values, weights in [*measures, ("reuse_gap", gaps.gaps, gaps.blocks)]:
        if not len(values):
            continue
        edges = [0, 1] + [1 << k for k in range(1, int(values.max()).bit_length() + 1)]
        counts, _ = np.histogram(values, bins=edges, weights=weights)
        rows += [(name, lo, hi - 1, int(c)) for lo, hi, c in
                 zip(edges, edges[1:], counts, strict=False)]
    return rows


def sizing_advice(res: Residency, gaps: ReuseGaps, pool_blocks: int,
                  curve: list[tuple[int, float]], ceiling: float) -> str:
    """The check users do by hand, read off the LRU miss-ratio curve [(pool blocks, ratio)]."""
    gap, idle = gaps.percentile(90), res.percentile("idle_before_evict", 50)
    if gap is None or idle is None:
        return "no block was both evicted and referenced again: nothing to advise"
    now = min(curve, key=lambda p: abs(p[0] - pool_blocks))[1]
    if gap <= idle:
        return (f"reuse gap p90 {gap:,.0f} <= idle-before-evict p50 {idle:,.0f} requests: the "
                f"pool keeps blocks long enough for their reuse (LRU hit ratio {now:.1%}, "
                f"infinite cache {ceiling:.1%})")
    target = next(((n, r) for n, r in curve if n > pool_blocks and r >= 0.9 * ceiling),
                  max(curve))
    return (f"reuse gap p90 {gap:,.0f} > idle-before-evict p50 {idle:,.0f} requests: the pool "
            f"is too small for this traffic; about {target[0] - pool_blocks:,} more blocks "
            f"would lift the LRU hit ratio from {now:.1%} to {target[1]:.1%} (infinite cache "
            f"{ceiling:.1%})")
