"""The engine: scheduler + cache manager + model runner, one step at a time.

Not thread-safe: drive it from one thread (in the window, the engine runs in its own process:
app/host/server.py). What happens inside leaves only through the step stream (`subscribe`, see
stream.py) and the public methods below; `manager`, `scheduler` and `requests` are internals.
"""

from __future__ import annotations

import operator
import time
import traceback
from collections import deque

import numpy as np
import torch

from kvscope.engine import events as ev
from kvscope.engine.config import (
    DEFAULT_CPU_BLOCKS,
    EngineConfig,
    SamplingParams,
    is_int,
    why_not_text,
)
from kvscope.engine.dead import dead_blocks_in_pool
from kvscope.engine.explain import MissExplanation
from kvscope.engine.forward_timer import ForwardTimer
from kvscope.engine.kv_cache_manager import KVCacheManager
from kvscope.engine.metrics import RequestMetrics, StepRecord
from kvscope.engine.model_runner import ModelRunner, SeqChunk, blocks_that_fit
from kvscope.engine.models.load import LoadedModel, load_model
from kvscope.engine.outputs import RequestOutput
from kvscope.engine.request import Request, Status
from kvscope.engine.sampler import make_generator, sample
from kvscope.engine.scheduler import ScheduledChunk, Scheduler
from kvscope.engine.snapshot import CacheCounters, PoolState, Snapshot
from kvscope.engine.stream import NewRequest, StepUpdate
from kvscope.engine.token_text import TokenPieces, first_stop

FINISHED_HISTORY = 1024  # finished requests kept for cancel() and explain_miss; older retire


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.device = torch.device(config.device)
        num_blocks = config.num_blocks or (
            DEFAULT_CPU_BLOCKS if self.device.type != "cuda" else blocks_that_fit(
                loaded, config.block_size, config.kv_cache_dtype, self.device,
                config.gpu_memory_fraction))
        self.runner = ModelRunner(loaded, num_blocks, config.block_size, config.kv_cache_dtype,
                                  self.device, prepack_cpu_weights=config.prepack_cpu_weights,
                                  max_num_seqs=config.max_num_seqs)
        host_blocks = config.host_blocks or config.host_bytes // self.runner.kv_bytes_per_block
        if config.host_bytes and not host_blocks:
            raise ValueError(f"host_bytes {config.host_bytes} holds no block of "
                             f"{self.runner.kv_bytes_per_block} bytes")
        if host_blocks:
            self.runner.add_host_tier(host_blocks)
        self._calibrate = config.kv_scales == "calibrate"  # at the first forward pass
        if not self._calibrate and config.kv_scales != 1.0:
            self.runner.scale_kv(config.kv_scales)
        # the model part of every chain's root hash (see block_hash.ExtraKeys); the formats
        # added with kv_formats name themselves (the others keep the hashes they had)
        fmt = self.runner.format
        self.cache_identity = identity = f"{loaded.fingerprint}/{self.runner.cache_dtype}" + (
            "" if fmt.is_default else f"/{fmt.name}" + (f"/g{fmt.group}" if fmt.group else ""))
        self.manager = KVCacheManager(num_blocks, config.block_size,
                                      config.enable_prefix_caching, identity,
                                      config.record_events, config.eviction_policy,
                                      self.runner.groups, host_blocks,
                                      config.host_eviction_policy)
        if self.runner.residual is not None:  # a freed partial block's residual slot goes back
            self.manager.pool.on_free = self.runner.residual.on_free
        self.events = self.manager.events
        self.scheduler = Scheduler(config, self.manager)
        self.requests: dict[int, Request] = {}
        self.step_records: list[StepRecord] = []
        self._next_id = 0
        self._generators: dict[int, torch.Generator | None] = {}
        # Each unfinished request's output text, decoded incrementally (one short window per
        # token, as vLLM's detokenizer): decoding the whole output at every token costs time
        # in proportion to its length (0.7 ms at 4,000 tokens, per request and step).
        self._detok: dict[int, TokenPieces] = {}
        self._pending: list[RequestOutput] = []  # rejected / cancelled, reported by next step
        self._failures: list[tuple[int, str, str]] = []  # this step's, see StepUpdate
        self._new: list[NewRequest] = []  # arrived since the last step
        self._finished: deque[int] = deque()  # finished requests, oldest first, to retire
        self._subscribers: list = []
        self.num_steps = 0
        self.eos_token_ids = set(loaded.config.eos_token_ids)

    @classmethod
    def from_pretrained(cls, model: str, config: EngineConfig | None = None) -> Engine:
        config = config or EngineConfig()
        return cls(load_model(model, device=config.device, dtype=config.dtype), config)

    # -------------------------------------------------------------- public API
    @property
    def num_blocks(self) -> int:
        return self.manager.pool.num_blocks

    @property
    def kv_bytes_per_token(self) -> float:
        """The KV cache's bytes per token (every layer, K and V): a block's are this times
        block_size (the bytes a host-tier copy moves)."""
        return self.runner.kv_bytes_per_token

    @property
    def num_host_blocks(self) -> int:
        """The host tier's size in blocks (0: none)."""
        return 0 if self.manager.host is None else self.manager.host.pool.num_blocks

    @property
    def groups(self) -> tuple:
        """The model's KV-cache groups (kv_groups.KVGroup), each with its own block tables."""
        return self.manager.groups

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    cache_salt: str | None = None, cache_breakpoint: int | None = None) -> int:
        """Queue a request. A prompt that can never fit is rejected: the request finishes at
        once with finish_reason "rejected" and an `error`, and the engine serves the rest.
        `cache_breakpoint`: tokens of the prompt an API would cache (recorded for the lab's
        billing; the engine caches every full block)."""
        params = params or SamplingParams()
        if not isinstance(prompt, (str, list, tuple)):
            raise TypeError(f"a prompt is a str or a list of token ids, not "
                            f"{type(prompt).__name__}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, not {type(cache_salt).__name__}")
        cache_salt = cache_salt or None  # as vLLM: an empty salt is no salt
        if cache_breakpoint is not None and not (is_int(cache_breakpoint)
                                                 and cache_breakpoint >= 0):
            raise ValueError(f"cache_breakpoint must be None or tokens >= 0, got "
                             f"{cache_breakpoint!r}")
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError(f"{self.loaded.name} has no tokenizer files: pass token ids")
        problem = why_not_text(prompt, "the prompt") or why_not_text(cache_salt,
                                                                        "the cache salt")
        if problem:
            ids = []
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids, problem = self._token_ids(prompt)
        rid, self._next_id = self._next_id, self._next_id + 1
        req = Request(rid, ids, params, RequestMetrics(time.monotonic(), prompt_tokens=len(ids)),
                      cache_salt, pending_forks=params.n - 1, cache_breakpoint=cache_breakpoint)
        self.requests[rid] = req
        self._new.append(self._new_request(req))
        self._generators[rid] = make_generator(params)
        problem = problem or self._why_it_never_fits(req)
        if problem:
            self._reject(req, problem)
        else:
            self.events.arrived(self.manager.step, rid, len(ids))
            self.scheduler.add(req)
        return rid

    def _token_ids(self, prompt) -> tuple[list[int], str | None]:
        """The prompt's token ids, or why they cannot be (not integers, outside the vocabulary)."""
        vocab = self.loaded.config.vocab_size
        try:
            ids = [operator.index(t) for t in prompt]
        except TypeError:
            bad = next(t for t in prompt if not hasattr(t, "__index__"))
            return [], f"token ids must be integers, got {type(bad).__name__} {bad!r:.40}"
        if ids and not (min(ids) >= 0 and max(ids) < vocab):
            bad = next(t for t in ids if not 0 <= t < vocab)
            return [], f"token id {bad} is outside the model's vocabulary [0, {vocab})"
        return ids, None

    def _reject(self, req: Request, why: str) -> None:
        """The request can never run: it finishes at once with the reason, alone."""
        self.scheduler.remove(req)
        if req.request_id in self.manager.seqs:
            self.manager.free(req.request_id)
        self.events.rejected(self.manager.step, req.request_id, why)
        self._finish(req, "rejected", error=why)

    def _why_it_never_fits(self, req: Request) -> str | None:
        n, bs = len(req.prompt_token_ids), self.config.block_size
        if n == 0:
            return "empty prompt"
        limit = self.loaded.config.max_position_embeddings
        if n + req.params.max_tokens > limit:
            return (f"prompt ({n} tokens) + max_tokens ({req.params.max_tokens}) exceeds the "
                    f"model's context of {limit} tokens")
        need = self.manager.peak_blocks(n + req.params.max_tokens,
                                        self.config.max_num_batched_tokens)
        if need > self.num_blocks:
            groups = f" in {len(self.manager.groups)} KV-cache groups" \
                if len(self.manager.groups) > 1 else ""
            return (f"prompt ({n} tokens) + max_tokens ({req.params.max_tokens}) needs {need} "
                    f"blocks of {bs} tokens{groups}; the KV pool has only {self.num_blocks}")
        return None

    def cancel(self, request_id: int) -> bool:
        """Cancel at any phase; its blocks are released. False if it had already finished."""
        req = self.requests.get(request_id)
        if req is None:
            if 0 <= request_id < self._next_id:
                return False  # finished long ago (retired)
            raise KeyError(f"no request {request_id}")
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
        final: dict[int, RequestOutput] = {}
        while self.has_unfinished():
            final.update((o.request_id, o) for o in self.step() if o.finished)
        samples: dict[int, list[RequestOutput]] = {}
        for o in sorted(final.values(), key=lambda o: o.sample_index):
            samples.setdefault(o.request_id if o.parent_id is None else o.parent_id, []).append(o)
        return [o for rid in ids for o in samples[rid]]

    def snapshot(self) -> Snapshot:
        return self.manager.snapshot()

    def dead_blocks(self) -> np.ndarray:
        """Cached blocks no lookup can reach any more, an ancestor in their chain having been
        evicted (engine/dead.py); costs about a microsecond per cached block."""
        return np.flatnonzero(dead_blocks_in_pool(self.manager.pool, self.groups))

    def explain_miss(self, request_id: int) -> MissExplanation:
        return self.manager.explain_miss(request_id)

    def subscribe(self, callback) -> None:
        """callback(StepUpdate) on the engine's thread at the end of every step (a failed one
        too). It must be quick and must not raise; a consumer on another thread subscribes a
        stream.StepQueue and drains it."""
        self._subscribers.append(callback)

    def unsubscribe(self, callback) -> None:
        self._subscribers.remove(callback)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (running requests keep their blocks)."""
        self.manager.reset_prefix_cache()

    def counters(self) -> CacheCounters:
        return self.manager.counters()

    def pool_state(self) -> PoolState:
        """A cheap copy of the block state (about 1 ms for 16k blocks, against about 10 ms for
        snapshot()), to be turned into a Snapshot on another thread."""
        return self.manager.pool_state()

    def request_output(self, request_id: int) -> RequestOutput | None:
        """A request's state now (None once retired from the finished history)."""
        req = self.requests.get(request_id)
        return None if req is None else self._output(req)

    def unfinished_requests(self) -> list[NewRequest]:
        """The requests not finished yet, as they entered (for a recorder started mid-run)."""
        return [self._new_request(r) for r in self.requests.values() if not r.finished]

    @staticmethod
    def _new_request(r: Request) -> NewRequest:
        return NewRequest(r.request_id, r.prompt_token_ids, r.params, r.metrics.arrival_s,
                          r.cache_salt, r.parent_id, r.sample_index, r.cache_breakpoint)

    # -------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One scheduler step: prefill chunks and decodes. Returns the requests that produced a
        token or finished."""
        t0 = time.monotonic()
        self.manager.begin_step(self.num_steps)
        rec = StepRecord(step=self.num_steps, start_s=t0,
                         warmup=self.num_steps < self.config.warmup_steps)
        outputs, self._pending, self._failures = self._pending, [], []
        try:
            if self.config.enable_kv_cache:
                self._step_paged(rec, t0, outputs)
            else:
                self._step_naive(rec, t0, outputs)
        finally:  # a failed step is still a step: recorded, counted and published
            pool = self.manager.pool
            rec.num_waiting = len(self.scheduler.waiting)
            rec.num_running = len(self.scheduler.running)
            rec.num_free_blocks, rec.num_active_blocks, rec.num_cached_blocks = pool.counts()
            rec.group_blocks, rec.window_freed_blocks = self.manager.group_counts()
            rec.wall_s = time.monotonic() - t0
            self.step_records.append(rec)
            self.num_steps += 1
            new, self._new = self._new, []
            events = self.events.drain()  # a subscriber who joins later gets no stale events
            if self._subscribers:
                mgr = self.manager
                update = StepUpdate(rec, events, outputs, new,
                                    mgr.new_explanations, mgr.num_computed(), mgr.counters(),
                                    self._failures)
                for fn in list(self._subscribers):
                    fn(update)
            self._retire()
        return outputs

    def _retire(self) -> None:
        """Forget the oldest finished requests beyond FINISHED_HISTORY: a long-lived engine
        keeps a bounded memory (a recording keeps everything)."""
        while len(self._finished) > FINISHED_HISTORY:
            rid = self._finished.popleft()
            self.requests.pop(rid, None)
            self._generators.pop(rid, None)
            self._detok.pop(rid, None)
            self.manager.explanations.pop(rid, None)

    def _fail(self, req: Request, message: str, outputs: list[RequestOutput]) -> None:
        """This request's forward pass or sampling raised: it finishes with the error and gives
        its blocks back; the engine stays consistent and serves the rest."""
        if req.finished:
            return
        self._release(req)
        self.events.finished(self.manager.step, req.request_id, f"error: {message}")
        self._finish(req, "error", error=message, report=False)
        outputs.append(self._output(req))
        self._failures.append((req.request_id, message, traceback.format_exc()))

    def _step_paged(self, rec: StepRecord, now: float, outputs: list[RequestOutput]) -> None:
        sched = self.scheduler.schedule(now)
        for req, why in sched.rejected:
            self._reject(req, why)
        rec.num_preempted = len(sched.preempted)
        rec.hit_tokens, rec.query_tokens = sched.hit_tokens, sched.query_tokens
        chunks = sched.chunks
        host = self.manager.host
        if host is not None and (host.offloads or host.loads):
            t0 = time.perf_counter()
            self.runner.transfer(host.offloads, host.loads)
            rec.transfer_s = time.perf_counter() - t0
            rec.offloaded_blocks, rec.loaded_blocks = len(host.offloads), len(host.loads)
        if not chunks:
            return
        if self._calibrate:
            self._calibrate = False
            self.runner.calibrate_kv_scales([c.request.prompt_token_ids for c in chunks])
        try:
            with ForwardTimer(self.device) as timer:
                logits = self.runner.run([self._seq_chunk(c) for c in chunks], sched.copies)
            timers = [timer]
        except Exception as e:  # noqa: BLE001 - isolate the culprit, serve the others
            chunks, logits, timers = self._run_one_by_one(chunks, sched.copies, e, outputs)
        work = [(c.request.request_id, c.num_tokens, self._is_decode(c)) for c in chunks]
        self._computed(rec.step, work)
        self._sample_all([c.request for c in chunks if self._completes(c)], logits, outputs)
        self._account(rec, work, sum(t.seconds() for t in timers))

    def _seq_chunk(self, c: ScheduledChunk) -> SeqChunk:
        first, *more = self.manager.block_tables(c.request.request_id)
        return SeqChunk(c.request.token_ids_between(c.start, c.start + c.num_tokens), c.start,
                        first, want_logits=self._completes(c), more_tables=tuple(more))

    def _run_one_by_one(self, chunks: list[ScheduledChunk], copies, error: Exception,
                        outputs: list[RequestOutput]):
        """The step's packed forward pass raised. Run its chunks again one at a time, in
        schedule order, so that only the request that makes the pass fail fails. Schedule order
        keeps every block written before it is read: a block registered in this step can only
        be hit by a request admitted after the one that registered it. A request that hit a
        block of a failed request read KV that was never written: it is preempted, to be
        recomputed. Returns the chunks that ran, their logits and their timers."""
        ran, rows, timers, poisoned = [], [], [], set()
        for i, c in enumerate(chunks):
            req = c.request
            if poisoned.intersection(self.manager.blocks_held(req.request_id)):
                self.scheduler.requeue(req)
                continue
            try:
                if len(chunks) == 1:
                    raise error
                with ForwardTimer(self.device) as timer:
                    logits = self.runner.run([self._seq_chunk(c)], copies if i == 0 else ())
            except Exception as e:  # noqa: BLE001
                poisoned.update(self.manager.uncache(req.request_id))
                self._fail(req, f"{type(e).__name__}: {e}", outputs)
                continue
            timers.append(timer)
            ran.append(c)
            rows.append(logits)
        logits = torch.cat(rows) if rows else torch.empty(0)
        return ran, logits, timers

    def _step_naive(self, rec: StepRecord, now: float, outputs: list[RequestOutput]) -> None:
        """Recompute every running sequence from scratch: no KV cache at all."""
        sched = self.scheduler
        while sched.waiting and len(sched.running) < self.config.max_num_seqs:
            req = sched.waiting.popleft()
            req.status = Status.RUNNING
            req.metrics.first_scheduled_s = now
            sched.running.append(req)
        reqs = list(sched.running)
        if not reqs:
            return
        try:
            with ForwardTimer(self.device) as timer:
                logits = self.runner.run_naive([r.all_token_ids for r in reqs])
            timers = [timer]
        except Exception:  # noqa: BLE001 - isolate the culprit, serve the others
            ok, rows, timers = [], [], []
            for r in reqs:
                try:
                    with ForwardTimer(self.device) as timer:
                        rows.append(self.runner.run_naive([r.all_token_ids]))
                except Exception as e:  # noqa: BLE001
                    self._fail(r, f"{type(e).__name__}: {e}", outputs)
                    continue
                timers.append(timer)
                ok.append(r)
            reqs, logits = ok, (torch.cat(rows) if rows else torch.empty(0))
        work = [(r.request_id, r.num_tokens, bool(r.output_token_ids)) for r in reqs]
        self._computed(rec.step, work)
        self._sample_all(reqs, logits, outputs)
        self._account(rec, work, sum(t.seconds() for t in timers))

    @staticmethod
    def _is_decode(c: ScheduledChunk) -> bool:
        return c.num_tokens == 1 and bool(c.request.output_token_ids) and \
            c.start == c.request.num_tokens - 1

    @staticmethod
    def _completes(c: ScheduledChunk) -> bool:
        """After this chunk every known token is computed: the request samples a token."""
        return c.start + c.num_tokens == c.request.num_tokens

    def _computed(self, step: int, work: list[tuple[int, int, bool]]) -> None:
        """work: (request id, tokens computed, is a decode) per sequence of the forward pass.
        Published before sampling, so a request's prefill/decode precedes its finish."""
        for rid, n, is_decode in work:
            self.events.emit(ev.DECODE if is_decode else ev.PREFILL, step, rid, detail=str(n))

    def _account(self, rec: StepRecord, work: list[tuple[int, int, bool]],
                 seconds: float) -> None:
        """work: (request id, tokens computed, is a decode) per sequence of the step's forward
        pass. Prefill and decode share that one pass: its time is split between them in
        proportion to their tokens."""
        decode = sum(n for _, n, is_decode in work if is_decode)
        prefill = sum(n for _, n, _ in work) - decode
        rec.prefill_tokens, rec.decode_tokens = prefill, decode
        total = prefill + decode
        rec.prefill_s = seconds * prefill / total if total else 0.0
        rec.decode_s = seconds - rec.prefill_s
        rec.batch_size = len(work)

    def _sample_all(self, reqs: list[Request], logits: torch.Tensor,
                    outputs: list[RequestOutput]) -> None:
        if not reqs:
            return
        now = time.monotonic()
        greedy = logits.argmax(dim=-1).tolist()  # one batched argmax, one transfer
        for i, req in enumerate(reqs):
            samples = [req] + self._fork(req)
            for r in samples:
                try:
                    token = greedy[i] if r.params.temperature == 0 else \
                        sample(logits[i], r.params, self._generators[r.request_id])
                except Exception as e:  # noqa: BLE001 - this request's sampling only
                    self._fail(r, f"{type(e).__name__}: {e}", outputs)
                    continue
                self._append_token(r, token, now)
                outputs.append(self._output(r))

    def _fork(self, parent: Request) -> list[Request]:
        """Parallel sampling: once the prompt is computed, fork the other samples. They share
        every prompt block; the partial last block is copied when each first writes to it."""
        children = []
        for k in range(1, parent.pending_forks + 1):
            rid, self._next_id = self._next_id, self._next_id + 1
            m = parent.metrics
            child = Request(rid, list(parent.prompt_token_ids), parent.params,
                            RequestMetrics(m.arrival_s, m.first_scheduled_s,
                                           prompt_tokens=m.prompt_tokens,
                                           cached_tokens=m.cached_tokens),
                            parent.cache_salt, parent_id=parent.request_id, sample_index=k,
                            status=Status.RUNNING,
                            num_computed_tokens=parent.num_computed_tokens)
            self.requests[rid] = child
            self._new.append(self._new_request(child))
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
        searched = len(req.text)  # no stop string ends before this: checked at earlier tokens
        if self.tokenizer is not None:
            pieces = self._detok.get(req.request_id)
            if pieces is None:
                pieces = self._detok[req.request_id] = TokenPieces(self.tokenizer)
            req.text += "".join(pieces.extend([token]))
        p = req.params
        if not p.ignore_eos and token in self.eos_token_ids:
            reason = "eos"
        elif p.stop and (cut := first_stop(req.text, p.stop, searched)) is not None:
            req.text = req.text[:cut]
            reason = "stop"
        elif len(req.output_token_ids) >= p.max_tokens:
            reason = "length"
        else:
            if self.config.enable_kv_cache:
                self.manager.append_token_ids(req.request_id, [token])
            return
        self._release(req)
        self.events.finished(self.manager.step, req.request_id, reason)
        self._finish(req, reason, report=False)

    def _release(self, req: Request) -> None:
        self.scheduler.remove(req)
        if req.request_id in self.manager.seqs:
            self.manager.free(req.request_id)

    def _finish(self, req: Request, reason: str, error: str | None = None,
                report: bool = True) -> None:
        req.status, req.finish_reason, req.error = Status.FINISHED, reason, error
        req.metrics.finished_s = time.monotonic()
        self._finished.append(req.request_id)
        self._generators.pop(req.request_id, None)
        self._detok.pop(req.request_id, None)
        if report:
            self._pending.append(self._output(req))

    def _output(self, req: Request) -> RequestOutput:
        return RequestOutput(req.request_id, list(req.output_token_ids), req.text, req.finished,
                             req.metrics.cached_tokens, req.metrics, req.finish_reason, req.error,
                             req.parent_id, req.sample_index, req.prompt_token_ids,
                             req.cache_salt)
