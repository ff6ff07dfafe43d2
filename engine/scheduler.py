"""Continuous batching: FCFS waiting and running queues under a per-step token budget.

Running requests are served first (decodes and the next chunks of long prompts), so a long prompt
never stalls running decodes; waiting requests are then admitted in arrival order while the
budget and the pool allow. When the pool cannot grow a running request, the newest running
request is preempted by recompute: it gives all its blocks back and returns to the front of the
waiting queue (its prefix may still be cached when it is readmitted).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvscope.engine import events as ev
from kvscope.engine.config import EngineConfig
from kvscope.engine.kv_cache_manager import KVCacheManager
from kvscope.engine.request import Request, Status


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # tokens already computed
    num_tokens: int  # tokens computed in this step


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted: list[Request] = field(default_factory=list)
    rejected: list[tuple[Request, str]] = field(default_factory=list)  # admission raised: why
    hit_tokens: int = 0  # first admissions only, as in the manager's counters
    query_tokens: int = 0


class Scheduler:
    def __init__(self, config: EngineConfig, manager: KVCacheManager):
        self.config = config
        self.manager = manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        mgr = self.manager
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not mgr.can_allocate(req.request_id, n):
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.copies += mgr.allocate(req.request_id, n)
                out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
                req.num_computed_tokens += n
                budget -= n
                i += 1
        if out.preempted:
            return out  # the pool is tight: admit nothing new this step
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            tokens = req.all_token_ids
            first = req.metrics.first_scheduled_s is None
            try:
                cached = mgr.admit(req.request_id, tokens, budget, cache_salt=req.cache_salt,
                                   count_stats=first)
            except Exception as e:  # noqa: BLE001 - reject it alone; the queue moves on
                self.waiting.popleft()
                if req.request_id in mgr.seqs:
                    mgr.free(req.request_id)
                out.rejected.append((req, f"admission failed: {type(e).__name__}: {e}"))
                continue
            if cached is None:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            n = min(len(tokens) - cached, budget)
            req.status = Status.RUNNING
            req.num_computed_tokens = cached + n
            if first:
                req.metrics.first_scheduled_s = now
                req.metrics.cached_tokens = cached
                req.metrics.host_cached_tokens = mgr.host_tokens(req.request_id)
                out.hit_tokens += cached
                out.query_tokens += len(tokens)
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, cached, n))
            mgr.events.admitted(mgr.step, req.request_id, cached, len(tokens) - cached)
            budget -= n
        return out

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self._give_back(req)
        out.preempted.append(req)

    def requeue(self, req: Request) -> None:
        """Preempt a running request now (its KV cannot be trusted): it is recomputed later."""
        self.running.remove(req)
        self._give_back(req)

    def _give_back(self, req: Request) -> None:
        """Preemption by recompute: all blocks back, first in line to be readmitted."""
        self.manager.free(req.request_id)
        self.manager.events.emit(ev.PREEMPTED, self.manager.step, req.request_id,
                                 detail=f"{req.num_computed_tokens} tokens to recompute")
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        req.metrics.num_preemptions += 1
        self.waiting.appendleft(req)

    def remove(self, req: Request) -> None:
        """Take a request out of whichever queue holds it; its blocks are freed by the caller."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
