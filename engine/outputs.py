"""What the engine hands back per request. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.engine.metrics import RequestMetrics


@dataclass
class RequestOutput:
    request_id: int
    token_ids: list[int]  # output tokens so far
    text: str
    finished: bool
    num_cached_tokens: int  # prompt tokens served from the prefix cache at first admission
    metrics: RequestMetrics
    finish_reason: str | None = None  # stop | eos | length | cancelled | rejected
    error: str | None = None  # why a request was rejected
    parent_id: int | None = None  # parallel sampling: the request this sample was forked from
    sample_index: int = 0
    prompt_token_ids: list[int] | None = None  # the prompt as the engine saw it (not a copy)
    cache_salt: str | None = None
