"""Residency analytics for one what-if replay (sequential mode; time is counted in requests):
per block, lifetime (hash stored -> evicted), idle time before eviction (last hit or store ->
evicted) and reuse gap (between consecutive uses: store -> first hit, hit -> next hit), plus
the dead cache (resident but unreachable blocks) sampled along the run."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvscope.engine import events as ev
from kvscope.engine.lab.dead import dead_blocks_in_pool


@dataclass
class Residency:
    sample_every: int = 0  # requests between dead-cache samples; 0: none
    lifetime: list[int] = field(default_factory=list)
    idle_before_evict: list[int] = field(default_factory=list)
    reuse_gap: list[int] = field(default_factory=list)
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
                    self.reuse_gap.append(i - self._last[b])
                    self._last[b] = i
            elif e.kind == ev.EVICTED:
                for b in e.blocks:
                    self.lifetime.append(i - self._stored.pop(b))
                    self.idle_before_evict.append(i - self._last.pop(b))
        if self.sample_every and i % self.sample_every == 0:
            self.dead.append((i, int(dead_blocks_in_pool(mgr.pool).sum())))

    def percentile(self, name: str, q: float) -> float | None:
        values = getattr(self, name)
        return float(np.percentile(values, q)) if values else None

    def histograms(self) -> list[tuple[str, int, int, int]]:
        """(measure, bin low, bin high, blocks) in power-of-two bins of requests."""
        rows = []
        for name in ("lifetime", "idle_before_evict", "reuse_gap"):
            values = np.asarray(getattr(self, name), dtype=np.int64)
            if not len(values):
                continue
            edges = [0, 1] + [1 << k for k in range(1, int(values.max()).bit_length() + 1)]
            counts, _ = np.histogram(values, bins=edges)
            rows += [(name, lo, hi - 1, int(c)) for lo, hi, c in
                     zip(edges, edges[1:], counts, strict=False)]
        return rows


def sizing_advice(res: Residency, pool_blocks: int, curve: list[tuple[int, float]],
                  ceiling: float) -> str:
    """The check users do by hand, read off the LRU miss-ratio curve [(pool blocks, ratio)]."""
    gap, idle = res.percentile("reuse_gap", 90), res.percentile("idle_before_evict", 50)
    if gap is None or idle is None:
        return "no block was both evicted and reused: nothing to advise"
    now = min(curve, key=lambda p: abs(p[0] - pool_blocks))[1]
    if gap <= idle:
        return (f"reuse gap p90 {gap:.0f} <= idle-before-evict p50 {idle:.0f} requests: the "
                f"pool holds blocks long enough for their reuse (hit ratio {now:.1%}, ceiling "
                f"{ceiling:.1%})")
    target = next(((n, r) for n, r in curve if n > pool_blocks and r >= 0.9 * ceiling),
                  max(curve))
    return (f"reuse gap p90 {gap:.0f} > idle-before-evict p50 {idle:.0f} requests: the pool is "
            f"too small for this traffic; about {target[0] - pool_blocks:,} more blocks would "
            f"lift the hit ratio from {now:.1%} to {target[1]:.1%} (LRU; infinite cache "
            f"{ceiling:.1%})")
