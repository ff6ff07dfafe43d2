"""A sequential what-if run, step by step, for a viewer that shows it like a session: a trace
through the real `KVCacheManager` at one pool size and policy (and KV-cache groups: by default
the trace's), one step per request. At step i request i is admitted (its prompt's blocks, held
as running) and it is freed when step i+1 begins; hits, evictions and miss explanations are the
manager's own.

`WhatIfReplay.run()` is the one pass that gives every step's record, the events, the dead-cache
count (sampled) and each request's explanation; it reports progress and can be cancelled (it
is meant to run off a GUI thread). Along the way it keeps checkpoints: the pool between two
requests, the only state a step starts from (a clone without the history of dropped hashes).
`state_at(step)` then gives the pool at the end of any step (snapshot, that step's events, dead
blocks) from the nearest checkpoint before it, so going back costs a few steps, not a replay
from the start.

With a host tier (`host_blocks`, `host_policy`; whatif.replay's rules) a checkpoint holds the
host pool too, and each step's record counts the blocks offloaded and loaded in it.

Under the ttl policy (`ttl_s`) the pool's clock is the trace's: request i-1 is freed at its own
arrival's time, then the clock moves to request i's arrival (dropping what expired), as
whatif's sequential mode does; a miss on an expired block is explained as such. Every full
block is cached (no breakpoints, no minimum: lab.billing's replay has them).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvscope.engine import events as ev
from kvscope.engine.block_pool import BlockPool
from kvscope.engine.dead import dead_blocks_in_pool
from kvscope.engine.explain import MissExplanation
from kvscope.engine.kv_cache_manager import KVCacheManager
from kvscope.engine.kv_groups import KVGroup
from kvscope.engine.metrics import StepRecord
from kvscope.engine.snapshot import CacheCounters, Snapshot
from kvscope.lab.traces import Trace
from kvscope.lab.whatif import block_hashes

DEAD_SAMPLES = 200  # steps at which the pass counts dead blocks
CHECKPOINT_BYTES = 128 << 20  # what the checkpoints may hold, about
BYTES_PER_BLOCK = 300  # a checkpoint's pool, per block, about (lists, queue and hash entries)


@dataclass(frozen=True)
class StepState:
    """The pool at the end of one step."""

    snapshot: Snapshot
    events: list[ev.Event]  # that step's
    dead: np.ndarray  # resident blocks no lookup can reach


class _Cursor:
    """A manager at the end of some step (its events: that step's)."""

    def __init__(self, manager: KVCacheManager, step: int):
        self.manager, self.step, self.events = manager, step, []


class WhatIfReplay:
    def __init__(self, trace: Trace, pool_blocks: int, block_size: int = 16,
                 policy: str = "lru", keep_events: int | None = None,
                 groups: tuple[KVGroup, ...] | None = None, host_blocks: int = 0,
                 host_policy: str = "lru", ttl_s: float | None = None):
        trace.check_block_size(block_size)
        self.host_blocks, self.host_policy, self.ttl_s = host_blocks, host_policy, ttl_s
        self.trace, self.pool_blocks, self.block_size, self.policy = (
            trace, pool_blocks, block_size, policy)
        self.groups = trace.groups if groups is None else groups
        self.keep_events = keep_events  # the pass keeps the last this many events (None: all)
        self.num_steps = len(trace.requests)
        self.records: list[StepRecord] = []
        self.events: list[ev.Event] = []
        self.dead_counts: tuple[np.ndarray, np.ndarray] = (np.zeros(0), np.zeros(0))
        self.explanations: dict[int, MissExplanation] = {}
        self.cached: dict[int, int] = {}  # request -> prompt tokens from the cache (admitted)
        self.host_cached: dict[int, int] = {}  # of those, the tokens loaded from the host tier
        self.counters: list[CacheCounters] = []  # the manager's, after each step
        self.checkpoint_every = max(1, math.ceil(
            self.num_steps * pool_blocks * BYTES_PER_BLOCK / CHECKPOINT_BYTES))
        # step -> the pool (and the host's, or None) as that step begins (request step-1
        # freed), and the events so far
        self._checkpoints: dict[int, tuple[BlockPool, BlockPool | None, list[ev.Event]]] = {}
        self._hashes: list[list[bytes]] = []
        self._cursor: _Cursor | None = None
        self.done = False

    # ------------------------------------------------------------------ the pass
    def run(self, progress: Callable[[int, int], None] | None = None,
            cancelled: Callable[[], bool] | None = None) -> bool:
        """Replay every step once; False if `cancelled()` said so (then nothing is kept).
        progress(steps done, steps) is called now and then."""
        self._hashes = block_hashes(self.trace, self.block_size)
        mgr = self._manager()
        n = self.num_steps
        every_dead, every_report = max(1, n // DEAD_SAMPLES), max(1, n // 100)
        dead: list[tuple[int, int]] = []
        for i in range(n):
            if cancelled is not None and cancelled():
                self._checkpoints.clear()
                return False
            self._begin(mgr, i)
            begun = mgr.events.drain()
            if i % self.checkpoint_every == 0:  # the pools as step i begins, and its events
                host = _clone(mgr.host.pool) if mgr.host is not None else None
                self._checkpoints[i] = (_clone(mgr.pool), host, begun)
            events = begun + self._admit(mgr, i)
            self.events += events
            if self.keep_events is not None:
                del self.events[:-self.keep_events]
            self.records.append(self._record(mgr, i))
            self.counters.append(mgr.counters())
            self.explanations.update((w.request_id, w) for w in mgr.new_explanations)
            if i % every_dead == 0 or i == n - 1:
                dead.append((i, int(dead_blocks_in_pool(mgr.pool, mgr.groups).sum())))
            if progress is not None and (i % every_report == 0 or i == n - 1):
                progress(i + 1, n)
        self.dead_counts = tuple(np.array(c) for c in zip(*dead, strict=True)) if dead else \
            self.dead_counts
        self.done = True
        return True

    def _manager(self, pool: BlockPool | None = None, host: BlockPool | None = None
                 ) -> KVCacheManager:
        """A fresh manager, or one on checkpointed pools (clones of them)."""
        mgr = KVCacheManager(self.pool_blocks, self.block_size, eviction_policy=self.policy,
                             groups=self.groups, host_blocks=self.host_blocks,
                             host_eviction_policy=self.host_policy, ttl_s=self.ttl_s)
        if pool is not None:
            mgr.pool = _clone(pool)
        if mgr.host is not None:
            mgr.host.device = mgr.pool
            mgr.pool.evicted_keys = []
            if host is not None:
                mgr.host.pool = _clone(host)
        return mgr

    def _begin(self, mgr: KVCacheManager, i: int) -> None:
        """Step i begins on a manager at the end of step i-1: request i-1 is freed."""
        mgr.begin_step(i)
        if i - 1 in self.cached:
            mgr.free(i - 1)
        mgr.advance_clock(self.trace.requests[i].arrival_s)

    def _admit(self, mgr: KVCacheManager, i: int, count_stats: bool = True) -> list[ev.Event]:
        """Request i admitted (unless it is larger than the pool); the step's events."""
        r = self.trace.requests[i]
        if r.input_length > 0:  # (admit refuses one larger than the pool, which holds none)
            cached = mgr.admit(i, [0] * r.input_length, block_hashes=self._hashes[i],
                               count_stats=count_stats)
            if cached is not None and count_stats:  # the pass (a cursor knows it already)
                self.cached[i] = cached
                if mgr.host is not None and mgr.host_tokens(i):
                    self.host_cached[i] = mgr.host_tokens(i)
        return mgr.events.drain()

    def _record(self, mgr: KVCacheManager, i: int) -> StepRecord:
        counts, r = mgr.pool.counts(), self.trace.requests[i]
        cached = self.cached.get(i, 0)
        held, freed = mgr.group_counts()
        moved = (len(mgr.host.offloads), len(mgr.host.loads)) if mgr.host is not None else (0, 0)
        return StepRecord(
            i, r.arrival_s, prefill_tokens=r.input_length - cached, batch_size=1,
            num_running=int(i in self.cached), num_cached_blocks=counts.cached,
            num_free_blocks=counts.free, num_active_blocks=counts.active, hit_tokens=cached,
            query_tokens=r.input_length, group_blocks=held, window_freed_blocks=freed,
            offloaded_blocks=moved[0], loaded_blocks=moved[1])

    # ------------------------------------------------------------------ any step
    def state_at(self, step: int) -> StepState:
        """The pool at the end of `step` (the pass must have run)."""
        if not self.done:
            raise RuntimeError("the replay has not run")
        if not 0 <= step < self.num_steps:
            raise IndexError(f"step {step} is outside the replay (0 to {self.num_steps - 1})")
        start = step - step % self.checkpoint_every  # the checkpoint at or before it
        c = self._cursor
        if c is None or c.step > step or c.step < start - 1:
            pool, host, begun = self._checkpoints[start]
            c = self._cursor = _Cursor(self._manager(pool, host), start)
            c.manager.begin_step(start)
            c.manager.advance_clock(self.trace.requests[start].arrival_s)
            c.events = begun + self._admit(c.manager, start, count_stats=False)
        while c.step < step:
            c.step += 1
            self._begin(c.manager, c.step)
            c.events = self._admit(c.manager, c.step, count_stats=False)
        snap = c.manager.snapshot()
        snap.counters = self.counters[step]  # the cursor counts nothing: the pass's totals
        dead = dead_blocks_in_pool(c.manager.pool, c.manager.groups)
        return StepState(snap, c.events, np.flatnonzero(dead))

    def explanation(self, request_id: int, step: int | None = None) -> MissExplanation | None:
        """As the manager judged it when the request was admitted, if it was by `step` (None:
        the step last shown)."""
        if step is None:
            step = self._cursor.step if self._cursor is not None else -1
        return self.explanations.get(request_id) if request_id <= step else None


def _clone(pool: BlockPool) -> BlockPool:
    """The pool without its history of dropped hashes (only explanations read it, and the pass
    keeps those): a checkpoint several times smaller and cheaper to take. (A pickled copy
    would be smaller still, but pickling on a worker thread starves a GUI thread of the GIL.)"""
    dropped, pool.dropped = pool.dropped, OrderedDict()
    try:
        copy = pool.clone()
    finally:
        pool.dropped = dropped
    copy.evicted_history = 0
    return copy
