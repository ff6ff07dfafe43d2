"""The engine: scheduler + cache manager + model runner, one step at a time.

Not thread-safe: drive it from one thread (the GUI runs it in a worker thread). Observers that
live on other threads use `subscribe()`, which costs the engine one queue put per step.
"""

from __future__ import annotations

import itertools
import queue
import time
from dataclasses import dataclass, field

import torch

from kvscope.engine import events as ev
from kvscope.engine.config import DEFAULT_CPU_BLOCKS, EngineConfig, SamplingParams
from kvscope.engine.explain import MissExplanation
from kvscope.engine.kv_cache_manager import KVCacheManager
from kvscope.engine.loader import LoadedModel, load_model
from kvscope.engine.metrics import RequestMetrics, StepRecord
from kvscope.engine.model_runner import ModelRunner, SeqChunk
from kvscope.engine.outputs import RequestOutput
from kvscope.engine.request import Request, Status
from kvscope.engine.sampler import make_generator, sample
from kvscope.engine.scheduler import ScheduledChunk, Scheduler
from kvscope.engine.snapshot import Snapshot


@dataclass
class StepUpdate:
    """What one step published to subscribers."""

    record: StepRecord
    events: list[ev.Event]
    outputs: list[RequestOutput]
    explanations: list[MissExplanation] = field(default_factory=list)  # admissions this step


class Subscription:
    def __init__(self):
        self._queue: queue.SimpleQueue[StepUpdate] = queue.SimpleQueue()

    def drain(self) -> list[StepUpdate]:
        updates = []
        while True:
            try:
                updates.append(self._queue.get_nowait())
            except queue.Empty:
                return updates


class _ForwardTimer:
    """Forward-pass time: a monotonic clock on the CPU; CUDA events on the GPU, read after the
    sampler has synchronised anyway, so timing adds no synchronisation of its own."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
        else:
            self.seconds_ = time.perf_counter() - self.t0

    def seconds(self) -> float:
        return self.start.elapsed_time(self.end) / 1e3 if self.cuda else self.seconds_


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.device = torch.device(config.device)
        num_blocks = config.num_blocks or self._default_num_blocks(loaded)
        self.runner = ModelRunner(loaded, num_blocks, config.block_size, config.kv_cache_dtype,
                                  self.device)
        identity = f"{loaded.fingerprint}/{self.runner.cache_dtype}"
        self.manager = KVCacheManager(num_blocks, config.block_size,
                                      config.enable_prefix_caching, identity,
                                      config.record_events)
        self.events = self.manager.events
        self.scheduler = Scheduler(config, self.manager)
        self.requests: dict[int, Request] = {}
        self.step_records: list[StepRecord] = []
        self._ids = itertools.count()
        self._generators: dict[int, torch.Generator | None] = {}
        self._pending: list[RequestOutput] = []  # rejected / cancelled, reported by next step
        self._subscribers: list[Subscription] = []
        self._step_listeners: list = []
        self.num_steps = 0
        self.eos_token_ids = set(loaded.config.eos_token_ids)

    @classmethod
    def from_pretrained(cls, model: str, config: EngineConfig | None = None) -> Engine:
        config = config or EngineConfig()
        return cls(load_model(model, device=config.device, dtype=config.dtype), config)

    def _default_num_blocks(self, loaded: LoadedModel) -> int:
        if self.device.type != "cuda":
            return DEFAULT_CPU_BLOCKS
        probe = ModelRunner(loaded, 1, self.config.block_size, self.config.kv_cache_dtype,
                            self.device)
        free, _ = torch.cuda.mem_get_info(self.device)
        per_block = probe.kv_bytes_per_token * self.config.block_size
        del probe
        return max(1, int(free * self.config.gpu_memory_fraction) // per_block)

    # -------------------------------------------------------------- public API
    @property
    def num_blocks(self) -> int:
        return self.manager.pool.num_blocks

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    cache_salt: str | None = None) -> int:
        """Queue a request. A prompt that can never fit is rejected: the request finishes at
        once with finish_reason "rejected" and an `error`, and the engine serves the rest."""
        params = params or SamplingParams()
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError(f"{self.loaded.name} has no tokenizer files: pass token ids")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        rid = next(self._ids)
        req = Request(rid, ids, params, RequestMetrics(time.monotonic(), prompt_tokens=len(ids)),
                      cache_salt, pending_forks=params.n - 1)
        self.requests[rid] = req
        self._generators[rid] = make_generator(params)
        problem = self._why_it_never_fits(req)
        if problem:
            self.events.emit(ev.REJECTED, self.manager.step, rid, detail=problem)
            self._finish(req, "rejected", error=problem)
        else:
            self.events.emit(ev.ARRIVED, self.manager.step, rid, detail=f"{len(ids)} tokens")
            self.scheduler.add(req)
        return rid

    def _why_it_never_fits(self, req: Request) -> str | None:
        n, bs = len(req.prompt_token_ids), self.config.block_size
        if n == 0:
            return "empty prompt"
        limit = self.loaded.config.max_position_embeddings
        if n + req.params.max_tokens > limit:
            return (f"prompt ({n} tokens) + max_tokens ({req.params.max_tokens}) exceeds the "
                    f"model's context of {limit} tokens")
        need = -(-(n + req.params.max_tokens) // bs)
        if need > self.num_blocks:
            return (f"prompt ({n} tokens) + max_tokens ({req.params.max_tokens}) needs {need} "
                    f"blocks of {bs} tokens; the KV pool has only {self.num_blocks}")
        return None

    def cancel(self, request_id: int) -> bool:
        """Cancel at any phase; its blocks are released. False if it had already finished."""
        req = self.requests[request_id]
        if req.finished:
            return False
        self._release(req)
        self.events.emit(ev.CANCELLED, self.manager.step, request_id)
        self._finish(req, "cancelled")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Run to completion. One output per sample, in prompt order (samples of a prompt
        follow it when n > 1)."""
        ids = [self.add_request(p, params, cache_salt) for p in prompts]
        while self.has_unfinished():
            self.step()
        order = []
        for rid in ids:
            order.append(rid)
            order += [r.request_id for r in self.requests.values() if r.parent_id == rid]
        return [self._output(self.requests[r]) for r in order]

    def snapshot(self) -> Snapshot:
        return self.manager.snapshot()

    def explain_miss(self, request_id: int) -> MissExplanation:
        return self.manager.explain_miss(request_id)

    def subscribe(self) -> Subscription:
        sub = Subscription()
        self._subscribers.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subscribers.remove(sub)

    def add_step_listener(self, fn) -> None:
        """fn(StepUpdate) on the engine thread at the end of every step (a failed one too).
        It must be quick and must not raise: the recorder's capture uses this."""
        self._step_listeners.append(fn)

    def remove_step_listener(self, fn) -> None:
        self._step_listeners.remove(fn)

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One scheduler step: prefill chunks and decodes. Returns the requests that produced a
        token or finished."""
        t0 = time.monotonic()
        self.manager.step = self.num_steps
        rec = StepRecord(step=self.num_steps, start_s=t0,
                         warmup=self.num_steps < self.config.warmup_steps)
        outputs, self._pending = self._pending, []
        try:
            if self.config.enable_kv_cache:
                self._step_paged(rec, t0, outputs)
            else:
                self._step_naive(rec, t0, outputs)
        finally:  # a failed step is still a step: recorded, counted and published
            pool = self.manager.pool
            rec.num_waiting = len(self.scheduler.waiting)
            rec.num_running = len(self.scheduler.running)
            rec.num_cached_blocks = pool.num_cached
            rec.num_free_blocks = pool.num_available - pool.num_cached
            rec.num_active_blocks = pool.num_blocks - pool.num_available
            rec.wall_s = time.monotonic() - t0
            self.step_records.append(rec)
            self.num_steps += 1
            if self._subscribers or self._step_listeners:
                events = self.events.drain()
                why = self.manager.explanations
                update = StepUpdate(rec, events, outputs,
                                    [why[e.request_id] for e in events
                                     if e.kind == ev.ADMITTED and e.request_id in why])
                for sub in self._subscribers:
                    sub._queue.put(update)
                for fn in list(self._step_listeners):
                    fn(update)
        return outputs

    def _fail(self, reqs: list[Request], error: Exception) -> None:
        """The forward pass or sampling raised: the requests in it finish with an error and give
        their blocks back, so the engine stays consistent and serves the rest."""
        message = f"{type(error).__name__}: {error}"
        for req in reqs:
            if not req.finished:
                self._release(req)
                self.events.emit(ev.FINISHED, self.manager.step, req.request_id,
                                 detail=f"error: {message}")
                self._finish(req, "error", error=message)

    def _step_paged(self, rec: StepRecord, now: float, outputs: list[RequestOutput]) -> None:
        sched = self.scheduler.schedule(now)
        rec.num_preempted = len(sched.preempted)
        rec.hit_tokens, rec.query_tokens = sched.hit_tokens, sched.query_tokens
        prefill = [c for c in sched.chunks if not self._is_decode(c)]
        decode = [c for c in sched.chunks if self._is_decode(c)]
        copies = sched.copies
        for group, is_prefill in ((prefill, True), (decode, False)):
            if not group:
                continue
            try:
                seq_chunks = [SeqChunk(c.request.token_ids_between(c.start, c.start + c.num_tokens),
                                       c.start, self.manager.block_table(c.request.request_id),
                                       want_logits=self._completes(c)) for c in group]
                with _ForwardTimer(self.device) as timer:
                    logits = self.runner.run(seq_chunks, copies)
                copies = []
                self._sample_all([c.request for c in group if self._completes(c)], logits,
                                 outputs)
            except Exception as e:
                self._fail([c.request for c in sched.chunks], e)
                raise
            self._account(rec, group, timer.seconds(), is_prefill)

    def _step_naive(self, rec: StepRecord, now: float, outputs: list[RequestOutput]) -> None:
        """Recompute every running sequence from scratch: no KV cache at all."""
        sched = self.scheduler
        while sched.waiting and len(sched.running) < self.config.max_num_seqs:
            req = sched.waiting.popleft()
            req.status = Status.RUNNING
            req.metrics.first_scheduled_s = now
            sched.running.append(req)
        reqs = list(sched.running)
        for is_prefill in (True, False):
            group = [r for r in reqs if (not r.output_token_ids) == is_prefill]
            if not group:
                continue
            try:
                with _ForwardTimer(self.device) as timer:
                    logits = self.runner.run_naive([r.all_token_ids for r in group])
                self._sample_all(group, logits, outputs)
            except Exception as e:
                self._fail(reqs, e)
                raise
            chunks = [ScheduledChunk(r, 0, r.num_tokens) for r in group]
            self._account(rec, chunks, timer.seconds(), is_prefill)

    @staticmethod
    def _is_decode(c: ScheduledChunk) -> bool:
        return c.num_tokens == 1 and bool(c.request.output_token_ids) and \
            c.start == c.request.num_tokens - 1

    @staticmethod
    def _completes(c: ScheduledChunk) -> bool:
        """After this chunk every known token is computed: the request samples a token."""
        return c.start + c.num_tokens == c.request.num_tokens

    def _account(self, rec: StepRecord, chunks: list[ScheduledChunk], seconds: float,
                 is_prefill: bool) -> None:
        tokens = sum(c.num_tokens for c in chunks)
        kind = ev.PREFILL if is_prefill else ev.DECODE
        for c in chunks:
            self.events.emit(kind, rec.step, c.request.request_id, detail=str(c.num_tokens))
        if is_prefill:
            rec.prefill_s, rec.prefill_tokens = seconds, tokens
        else:
            rec.decode_s, rec.decode_tokens = seconds, tokens
        rec.batch_size += len(chunks)

    def _sample_all(self, reqs: list[Request], logits: torch.Tensor,
                    outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for req, row in zip(reqs, logits, strict=True):
            samples = [req] + self._fork(req)
            for r in samples:
                self._append_token(r, sample(row, r.params, self._generators[r.request_id]), now)
                outputs.append(self._output(r))

    def _fork(self, parent: Request) -> list[Request]:
        """Parallel sampling: once the prompt is computed, fork the other samples. They share
        every prompt block; the partial last block is copied when each first writes to it."""
        children = []
        for k in range(1, parent.pending_forks + 1):
            rid = next(self._ids)
            m = parent.metrics
            child = Request(rid, list(parent.prompt_token_ids), parent.params,
                            RequestMetrics(m.arrival_s, m.first_scheduled_s,
                                           prompt_tokens=m.prompt_tokens,
                                           cached_tokens=m.cached_tokens),
                            parent.cache_salt, parent_id=parent.request_id, sample_index=k,
                            status=Status.RUNNING,
                            num_computed_tokens=parent.num_computed_tokens)
            self.requests[rid] = child
            self._generators[rid] = make_generator(parent.params, salt=k)
            if self.config.enable_kv_cache:
                self.manager.fork(parent.request_id, rid)
            self.scheduler.running.append(child)
            children.append(child)
        parent.pending_forks = 0
        return children

    def _append_token(self, req: Request, token: int, now: float) -> None:
        req.output_token_ids.append(token)
        req.metrics.token_times_s.append(now)
        if req.metrics.first_token_s is None:
            req.metrics.first_token_s = now
        if self.tokenizer is not None:
            req.text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        p = req.params
        if not p.ignore_eos and token in self.eos_token_ids:
            reason = "eos"
        elif any(s in req.text for s in p.stop):
            req.text = req.text[: min(req.text.find(s) for s in p.stop if s in req.text)]
            reason = "stop"
        elif len(req.output_token_ids) >= p.max_tokens:
            reason = "length"
        else:
            if self.config.enable_kv_cache:
                self.manager.append_token_ids(req.request_id, [token])
            return
        self._release(req)
        self.events.emit(ev.FINISHED, self.manager.step, req.request_id, detail=reason)
        self._finish(req, reason, report=False)

    def _release(self, req: Request) -> None:
        self.scheduler.remove(req)
        if req.request_id in self.manager.seqs:
            self.manager.free(req.request_id)

    def _finish(self, req: Request, reason: str, error: str | None = None,
                report: bool = True) -> None:
        req.status, req.finish_reason, req.error = Status.FINISHED, reason, error
        req.metrics.finished_s = time.monotonic()
        if report:
            self._pending.append(self._output(req))

    def _output(self, req: Request) -> RequestOutput:
        return RequestOutput(req.request_id, list(req.output_token_ids), req.text, req.finished,
                             req.metrics.cached_tokens, req.metrics, req.finish_reason, req.error,
                             req.parent_id, req.sample_index)
