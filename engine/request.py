"""A request as the scheduler sees it. Torch-free."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvscope.engine.config import SamplingParams
from kvscope.engine.metrics import RequestMetrics


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    cache_salt: str | None = None
    parent_id: int | None = None  # for samples 1..n-1 of a parallel-sampling request
    sample_index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    finish_reason: str | None = None  # stop | length | eos | cancelled | rejected | error
    error: str | None = None
    text: str = ""
    pending_forks: int = 0  # samples still to fork when this request's prompt is done
    cache_breakpoint: int | None = None  # an API would cache the prompt up to here (the lab)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (decode steps need one)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:end] + self.output_token_ids[:max(0, end - p)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_prefill(self) -> bool:
        """Computing the prompt, or recomputing known tokens after a preemption."""
        return not self.output_token_ids or self.num_computed_tokens < self.num_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
