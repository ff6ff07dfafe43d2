"""The step stream: the one way out of the engine. Torch-free.

After every step (a failed one too) the engine hands each subscriber one `StepUpdate`, on the
engine's thread: `engine.subscribe(callback)`. A consumer on another thread subscribes a
`StepQueue` and drains it. Everything a consumer needs is here or in the public API (snapshot,
pool_state, explain_miss, counters): the recorder, the engine process, the workload summary and
the CLI read nothing else.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field

from kvscope.engine.config import SamplingParams
from kvscope.engine.events import Event
from kvscope.engine.explain import MissExplanation
from kvscope.engine.metrics import StepRecord
from kvscope.engine.outputs import RequestOutput
from kvscope.engine.snapshot import CacheCounters

__all__ = ["CacheCounters", "NewRequest", "StepQueue", "StepUpdate"]


@dataclass(frozen=True, slots=True)
class NewRequest:
    """A request as it entered the engine (parallel samples enter when they are forked)."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float  # time.monotonic()
    cache_salt: str | None = None
    parent_id: int | None = None
    sample_index: int = 0
    cache_breakpoint: int | None = None  # tokens an API would cache (kvscope.lab.billing)


@dataclass
class StepUpdate:
    """What one step published.

    Request lifecycle: `new_requests` (arrived since the last step), then the events of the
    step (ARRIVED, ADMITTED with cached and computed tokens, PREEMPTED, FINISHED with its
    reason, CANCELLED, REJECTED with its reason), `outputs` (tokens appended, and the final
    state of each request that finished), `explanations` (why each admission missed, made at
    admission). Cache: the block events and `counters` after the step."""

    record: StepRecord
    events: list[Event]
    outputs: list[RequestOutput]
    new_requests: list[NewRequest] = field(default_factory=list)
    explanations: list[MissExplanation] = field(default_factory=list)
    num_computed_tokens: dict[int, int] = field(default_factory=dict)  # live requests' KV
    counters: CacheCounters = field(default_factory=CacheCounters)
    failures: list[tuple[int, str, str]] = field(default_factory=list)  # (request, error,
    #                                   traceback): forward passes or sampling that raised


class StepQueue:
    """A subscriber for a consumer on another thread: `engine.subscribe(q)`, then `q.drain()`.
    One queue put per step on the engine's thread."""

    def __init__(self):
        self._queue: queue.SimpleQueue[StepUpdate] = queue.SimpleQueue()

    def __call__(self, update: StepUpdate) -> None:
        self._queue.put(update)

    def drain(self) -> list[StepUpdate]:
        updates = []
        while True:
            try:
                updates.append(self._queue.get_nowait())
            except queue.Empty:
                return updates
