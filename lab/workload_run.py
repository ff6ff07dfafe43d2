"""Feed a workload to an engine. `WorkloadRunner(engine, workload).run()` submits each request
when its arrival time has come (sleeping while the engine is idle and the next arrival is in the
future), handles ``follows``, steps the engine until everything has finished and reports
progress as ``on_progress(done, total)`` over workload request lines. `summarize(engine,
result)` turns the run into the numbers the CLI prints. Torch-free: the runner only talks to the
engine object it is given.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvscope.engine.chat import chat_prompt_ids
from kvscope.engine.outputs import RequestOutput
from kvscope.engine.snapshot import HitRates
from kvscope.lab.workload import Workload, WorkloadError, WorkloadRequest

NORMAL_FINISHES = ("stop", "eos", "length")


@dataclass
class LineResult:
    """What became of one request line."""

    request: WorkloadRequest
    request_id: int | None = None  # the engine's id; None if never submitted
    submitted_s: float | None = None
    outputs: list[RequestOutput] = field(default_factory=list)  # samples 0..n-1, once finished
    skipped: str | None = None  # why the line was never submitted
    messages: list[dict] | None = None  # chat lines: the conversation sent

    @property
    def done(self) -> bool:
        return self.skipped is not None or (self.request_id is not None and bool(self.outputs))


@dataclass
class WorkloadResult:
    lines: list[LineResult]
    start_s: float  # time.monotonic() when the run started
    end_s: float = 0.0
    first_step: int = 0  # index into engine.step_records of the run's first step
    num_steps: int = 0
    evicted_before: int = 0  # the pool's eviction counter when the run started
    cancelled: bool = False  # stop() was called

    @property
    def outputs(self) -> list[RequestOutput]:
        """Every finished sample, in line order."""
        return [o for line in self.lines for o in line.outputs]

    @property
    def request_ids(self) -> list[int]:
        return [line.request_id for line in self.lines if line.request_id is not None]


class WorkloadRunner:
    """Drives an engine with a workload. `run()` blocks until the workload is done; a caller
    with its own loop (a GUI worker) calls `advance()` repeatedly instead."""

    def __init__(self, engine, workload: Workload,
                 on_progress: Callable[[int, int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.engine = engine
        self.workload = workload
        self.on_progress = on_progress
        self.clock, self.sleep = clock, sleep
        self.result: WorkloadResult | None = None
        self._pending: list[LineResult] = []  # not yet submitted, by (arrival, line)
        self._by_rid: dict[int, LineResult] = {}
        self._by_id: dict[str, LineResult] = {}
        self._finished_at: dict[str, float] = {}  # workload id -> when it finished
        self._final: dict[int, RequestOutput] = {}  # request id -> its last (finished) output
        self._samples: dict[int, list[int]] = {}  # a line's request id -> every sample's id
        self._num_done = 0
        vocab = engine.loaded.config.vocab_size
        for r in workload.requests:
            if r.needs_tokenizer and engine.tokenizer is None:
                raise WorkloadError(f"{workload.source}:{r.line}: the model has no "
                                    "tokenizer; use prompt_ids and no prefix")
            beyond = [t for t in r.prompt_ids or () if t >= vocab]
            if beyond:
                raise WorkloadError(f"{workload.source}:{r.line}: token id {beyond[0]} in "
                                    f"prompt_ids is beyond the model's vocabulary of {vocab}")
        chat = next((r for r in workload.requests if r.chat), None)
        if chat is not None and not getattr(engine.tokenizer, "chat_template", None):
            raise WorkloadError(f"{workload.source}:{chat.line}: a chat line needs a model with "
                                "a chat template (SmolLM2 has one: --model smollm2)")

    @property
    def total(self) -> int:
        return len(self.workload.requests)

    def start(self) -> None:
        engine = self.engine
        lines = [LineResult(r) for r in self.workload.requests]
        self.result = WorkloadResult(lines, self.clock(), first_step=len(engine.step_records),
                                     evicted_before=engine.counters().num_evicted_blocks)
        self._pending = sorted(lines, key=lambda x: (x.request.arrival_s, x.request.line))
        self._by_id = {x.request.id: x for x in lines if x.request.id is not None}
        self._progress()

    def advance(self) -> float | None:
        """Submit every request that is due, then run one engine step if there is work.
        Returns None when the workload is done (other requests on a shared engine may still
        be running), 0.0 to be called again at once, or the seconds until the next arrival when
        the engine is idle."""
        if self.result is None:
            self.start()
        if self.result.cancelled:
            return None
        self._submit_due()
        if self._num_done == self.total:
            return self._finish()
        if self.engine.has_unfinished():
            self._collect(self.engine.step())
            return 0.0
        wait = self._next_due() - self.clock()
        if math.isinf(wait):  # the engine is idle, yet some of our requests never reported
            raise RuntimeError("workload stalled: the engine is idle but requests of this "
                               "workload did not finish through this runner (was the engine "
                               "stepped by someone else?)")
        return max(0.0, wait)

    def run(self) -> WorkloadResult:
        while (wait := self.advance()) is not None:
            if wait > 0:
                self.sleep(wait)
        return self.result

    def stop(self) -> None:
        """Cancel everything in flight and skip what is not submitted yet."""
        if self.result is None:
            self.start()
        self.result.cancelled = True
        for line in self._pending:
            line.skipped = "the run was stopped before it was submitted"
            self._num_done += 1
        self._pending = []
        inflight = [line for line in self._by_rid.values() if not line.done]
        for line in inflight:
            for rid in self._samples[line.request_id]:
                if rid not in self._final:
                    self.engine.cancel(rid)
        # The cancellations are reported by the next step; other users' requests (on a shared
        # engine) are left to their owner.
        while any(not line.done for line in inflight) and self.engine.has_unfinished():
            self._collect(self.engine.step())
        self._finish()

    # ------------------------------------------------------------------------ internals
    def _due_s(self, line: LineResult) -> float:
        due = self.result.start_s + line.request.arrival_s
        if line.request.follows is not None:
            due = max(due, self._finished_at.get(line.request.follows, math.inf))
        return due

    def _next_due(self) -> float:
        return min((self._due_s(x) for x in self._pending), default=math.inf)

    def _submit_due(self) -> None:
        now = self.clock()
        still = []
        for line in self._pending:
            req = line.request
            prev = self._by_id.get(req.follows) if req.follows is not None else None
            if prev is not None and prev.skipped is not None:
                line.skipped = f"follows {req.follows!r}, which was skipped"
            elif prev is not None and prev.done and prev.outputs[0].finish_reason \
                    not in NORMAL_FINISHES:
                line.skipped = f"follows {req.follows!r}, which was " \
                               f"{prev.outputs[0].finish_reason}"
            elif self._due_s(line) <= now:
                self._submit(line, prev, now)
            else:
                still.append(line)
                continue
            if line.skipped is not None:
                self._line_done(line, now)
        self._pending = still

    def _submit(self, line: LineResult, prev: LineResult | None, now: float) -> None:
        req, engine = line.request, self.engine
        if req.chat:
            if prev is not None:
                history = prev.messages + [{"role": "assistant", "content": prev.outputs[0].text}]
            else:
                history = [{"role": "system", "content": req.prefix_text}] * bool(req.prefix_text)
            line.messages = history + [{"role": "user", "content": req.prompt}]
            prompt = chat_prompt_ids(engine.tokenizer, line.messages)
        elif prev is not None:
            first = prev.outputs[0]
            tail = (engine.tokenizer.encode(req.prompt, add_special_tokens=False)
                    if req.prompt is not None else list(req.prompt_ids))
            prompt = list(first.prompt_token_ids) + list(first.token_ids) + tail
        elif req.prompt is not None:
            prompt = req.prefix_text + req.prompt
        elif req.prefix_text:
            prompt = list(engine.tokenizer.encode(req.prefix_text)) + list(req.prompt_ids)
        else:
            prompt = list(req.prompt_ids)
        breakpoint = req.cache_breakpoint
        if breakpoint == "prefix":  # (text: the prefix joined to the prompt, then encoded)
            breakpoint = len(engine.tokenizer.encode(req.prefix_text))
        line.request_id = engine.add_request(prompt, req.params, req.cache_salt, breakpoint)
        line.submitted_s = now
        self._by_rid[line.request_id] = line
        self._samples[line.request_id] = [line.request_id]

    def _collect(self, outputs: list[RequestOutput]) -> None:
        """Samples 1..n-1 are forked (and report) in the step in which the prompt is done, so
        once every sample seen so far has finished, the line is done."""
        touched = set()
        for out in outputs:
            root = out.request_id if out.parent_id is None else out.parent_id
            samples = self._samples.get(root)
            if samples is None:
                continue  # not ours (someone else's request on a shared engine)
            if out.request_id not in samples:
                samples.append(out.request_id)
            if out.finished:
                self._final[out.request_id] = out
                touched.add(root)
        for root in touched:
            line = self._by_rid[root]
            if not line.done and all(r in self._final for r in self._samples[root]):
                line.outputs = [self._final[r] for r in self._samples[root]]
                self._line_done(line, self.clock())

    def _line_done(self, line: LineResult, now: float) -> None:
        if line.request.id is not None:
            self._finished_at[line.request.id] = now
        self._num_done += 1
        self._progress()

    def _progress(self) -> None:
        if self.on_progress is not None:
            self.on_progress(self._num_done, self.total)

    def _finish(self) -> None:
        r = self.result
        if not r.end_s:
            r.end_s = self.clock()
            r.num_steps = len(self.engine.step_records) - r.first_step
        return None


# ------------------------------------------------------------------------------------ summary
@dataclass
class RunSummary(HitRates):
    """The numbers of one workload run, from the engine's own records."""

    num_lines: int
    num_requests: int  # engine requests, parallel samples included
    num_finished: int
    num_rejected: int
    num_cancelled: int
    num_skipped: int  # lines never submitted
    duration_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    prompt_tokens: int
    output_tokens: int
    measured_s: float  # the throughput window: after the warm-up steps, to the last finish
    output_tokens_per_s: float
    total_tokens_per_s: float  # (prompt + output tokens completed in the window) / window
    num_warmup_steps: int  # warm-up steps of this run left out of the throughput window
    warmup_s: float
    hit_tokens: int
    query_tokens: int
    num_requests_queried: int
    num_requests_hit: int
    num_evictions: int  # cached blocks whose hash was dropped to reuse the block
    num_preemptions: int
    num_steps: int
    # The host tier (None: the engine has none): of hit_tokens, those loaded back from it;
    # blocks copied there and back; the copies' time; a block's KV bytes (None: not known)
    host_hit_tokens: int | None = None
    offloaded_blocks: int = 0
    loaded_blocks: int = 0
    transfer_s: float = 0.0
    block_bytes: int | None = None


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(engine, result: WorkloadResult) -> RunSummary:
    reqs = [o.metrics for o in result.outputs]
    firsts = [o.metrics for o in result.outputs if o.parent_id is None]
    reasons = [o.finish_reason for o in result.outputs]
    admitted = [m for m in firsts if m.first_scheduled_s is not None]
    steps = engine.step_records[result.first_step:result.first_step + result.num_steps]
    warm = [s for s in steps if s.warmup]
    end = max([m.finished_s for m in reqs if m.finished_s is not None], default=result.end_s)
    window_start = max((s.start_s + s.wall_s for s in warm), default=result.start_s)
    if not warm or window_start >= end:
        window_start, warm = result.start_s, []

    def completed_after(t0: float) -> tuple[int, int]:
        out = sum(1 for m in reqs for t in m.token_times_s if t > t0)
        prompt = sum(m.prompt_tokens for m in firsts
                     if m.first_token_s is not None and m.first_token_s > t0)
        return out, prompt

    out_w, prompt_w = completed_after(window_start)
    if out_w == 0 and warm:  # everything happened during warm-up: measure the whole run
        window_start, warm = result.start_s, []
        out_w, prompt_w = completed_after(window_start)
    measured = max(end - window_start, 1e-9)
    ttft = [m.ttft_s for m in firsts if m.ttft_s is not None]
    tpot = [m.tpot_s for m in reqs if m.tpot_s is not None]
    return RunSummary(
        num_lines=len(result.lines), num_requests=len(reqs),
        num_finished=sum(r in NORMAL_FINISHES for r in reasons),
        num_rejected=reasons.count("rejected"), num_cancelled=reasons.count("cancelled"),
        num_skipped=sum(x.skipped is not None for x in result.lines),
        duration_s=result.end_s - result.start_s,
        ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        tpot_p50_s=percentile(tpot, 50), tpot_p99_s=percentile(tpot, 99),
        prompt_tokens=sum(m.prompt_tokens for m in firsts),
        output_tokens=sum(m.output_tokens for m in reqs),
        measured_s=measured, output_tokens_per_s=out_w / measured,
        total_tokens_per_s=(out_w + prompt_w) / measured,
        num_warmup_steps=len(warm), warmup_s=sum(s.wall_s for s in warm),
        hit_tokens=sum(m.cached_tokens for m in admitted),
        query_tokens=sum(m.prompt_tokens for m in admitted),
        num_requests_queried=len(admitted),
        num_requests_hit=sum(m.cached_tokens > 0 for m in admitted),
        num_evictions=engine.counters().num_evicted_blocks - result.evicted_before,
        num_preemptions=sum(s.num_preempted for s in steps),
        num_steps=len(steps),
        host_hit_tokens=(sum(m.host_cached_tokens for m in admitted)
                         if engine.num_host_blocks else None),
        offloaded_blocks=sum(s.offloaded_blocks for s in steps),
        loaded_blocks=sum(s.loaded_blocks for s in steps),
        transfer_s=sum(s.transfer_s for s in steps),
        block_bytes=round(engine.kv_bytes_per_token * engine.config.block_size),
    )
