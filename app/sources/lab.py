"""A what-if lab replay as a frame source: the window shows a trace replayed through the real
`KVCacheManager` at one pool size and policy like any session, read-only.

Sequential mode, one step per request: at step i request i is admitted (it holds its prompt's
blocks, shown as running), and it is freed when step i+1 begins. Hits and explanations are the
manager's own. The replay is deterministic, so a past step is shown by replaying again up to it
(from the start when the cursor moves back); one pass at opening gives the timeline."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvscope.app.frames import Frame, RequestRow, evicted_at
from kvscope.app.sources.base import MAX_EVENTS, FrameSource
from kvscope.engine.dead import dead_blocks_in_pool
from kvscope.engine.explain import MissExplanation
from kvscope.engine.kv_cache_manager import KVCacheManager
from kvscope.engine.metrics import StepRecord
from kvscope.lab.traces import Trace
from kvscope.lab.whatif import block_hashes
from kvscope.sessions import SessionError

DEAD_SAMPLES = 200  # steps at which the opening pass counts dead blocks, for the timeline
READ_ONLY = "A what-if lab replay cannot be changed: press Back to live to use the engine"


class LabSource(FrameSource):
    def __init__(self, trace: Trace, pool_blocks: int, block_size: int = 16,
                 policy: str = "lru"):
        if not trace.requests:
            raise SessionError(f"{trace.name}: the trace has no requests")
        self.trace, self.pool_blocks, self.block_size, self.policy = (
            trace, pool_blocks, block_size, policy)
        self.name = f"lab: {Path(trace.name).name} at {pool_blocks:,} blocks, {policy}"
        self.read_only = READ_ONLY
        self._hashes = block_hashes(trace, block_size)
        self._restart()
        records, events, dead = [], [], []
        n = len(trace.requests)
        every = max(1, n // DEAD_SAMPLES)
        for i in range(n):
            self._advance()
            events += self._events
            del events[:-MAX_EVENTS]
            records.append(self._record(i))
            if i % every == 0 or i == n - 1:
                dead.append((i, int(dead_blocks_in_pool(self.manager.pool).sum())))
        self._first = Frame(records=records, events=events,
                            dead_counts=tuple(np.array(c) for c in zip(*dead, strict=True)))
        self._restart()

    def _restart(self) -> None:
        self.manager = KVCacheManager(self.pool_blocks, self.block_size,
                                      eviction_policy=self.policy)
        self.step = -1  # the step the manager is at the end of
        self._cached: dict[int, int] = {}  # request -> prompt tokens served from the cache
        self._events: list = []

    def _advance(self) -> None:
        """Run the next step."""
        mgr, i = self.manager, self.step + 1
        mgr.begin_step(i)
        if self.step in mgr.seqs:
            mgr.free(self.step)
        r = self.trace.requests[i]
        if 0 < r.input_length <= mgr.pool.num_blocks * self.block_size:
            self._cached[i] = mgr.admit(i, [0] * r.input_length, block_hashes=self._hashes[i])
        self.step = i
        self._events = mgr.events.drain()  # this step's

    def _record(self, i: int) -> StepRecord:
        pool, r = self.manager.pool, self.trace.requests[i]
        cached = self._cached.get(i, 0)
        return StepRecord(
            i, r.arrival_s, prefill_tokens=r.input_length - cached, batch_size=1,
            num_running=int(i in self.manager.seqs), num_cached_blocks=pool.num_cached,
            num_free_blocks=pool.num_available - pool.num_cached,
            num_active_blocks=pool.num_blocks - pool.num_available, hit_tokens=cached,
            query_tokens=r.input_length)

    def take_frame(self) -> Frame | None:
        first, self._first = self._first, None
        return first

    def step_range(self) -> tuple[int, int]:
        return 0, len(self.trace.requests) - 1

    def frame_at(self, step: int) -> Frame:
        if not 0 <= step < len(self.trace.requests):
            raise SessionError(f"step {step} is outside the replay (0 to "
                               f"{len(self.trace.requests) - 1})")
        if step < self.step:
            self._restart()
        while self.step < step:
            self._advance()
        return Frame(snapshot=self.manager.snapshot(), evicted=evicted_at(self._events, step),
                     requests=self._rows(step),
                     dead=np.flatnonzero(dead_blocks_in_pool(self.manager.pool)))

    def _rows(self, step: int) -> list[RequestRow]:
        rows = []
        for i in range(step + 1):
            r = self.trace.requests[i]
            state = "prefill" if i == step and i in self.manager.seqs else (
                "finished: length" if i in self._cached else "finished: rejected")
            rows.append(RequestRow(i, state, r.input_length, self._cached.get(i, 0), 0, None,
                                   None, None, None, ""))
        return rows

    def explain(self, request_id: int, step: int | None) -> MissExplanation | None:
        """As the manager judged it at admission (replayed up to `step` first)."""
        if step is not None and step != self.step:
            self.frame_at(step)
        return self.manager.explanations.get(request_id)

    def settings(self) -> dict:
        return {"model": f"lab: {Path(self.trace.name).name}", "num_blocks": self.pool_blocks,
                "block_size": self.block_size, "kv_cache_dtype": None,
                "enable_prefix_caching": True, "policy": self.policy}
