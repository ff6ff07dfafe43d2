"""What the window shows: a `Frame`, its request rows, and what the window knows of the engine.

Qt-free (the engine process builds frames). Frame sources (`app/sources/`) produce frames;
every panel renders them with `show_frame(frame)`, whatever the source."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvscope.engine import events as ev
from kvscope.engine.explain import MissExplanation
from kvscope.engine.metrics import StepRecord
from kvscope.engine.snapshot import Snapshot
from kvscope.engine.token_text import split_at


@dataclass
class RequestRow:
    request_id: int
    state: str  # waiting | prefill | decode | finished: <reason>
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    cache_salt: str | None
    parent_id: int | None
    text: str
    host_cached_tokens: int = 0  # of cached_tokens, those loaded back from the host tier

    @classmethod
    def new(cls, request_id: int, state: str, prompt_tokens: int, *, cached_tokens: int = 0,
            output_tokens: int = 0, ttft_s: float | None = None, tpot_s: float | None = None,
            cache_salt: str | None = None, parent_id: int | None = None,
            text: str = "", host_cached_tokens: int = 0) -> RequestRow:
        """A request's row: every source builds its rows with this (fields by name)."""
        return cls(request_id, state, prompt_tokens, cached_tokens, output_tokens, ttft_s, tpot_s,
                   cache_salt, parent_id, text, host_cached_tokens)


@dataclass
class RequestText:
    """One request's text cut at its token boundaries (`kvscope.engine.token_text`), for the
    text view: as much as the source knows (a session recorded without text knows none)."""

    request_id: int
    block_size: int
    prompt: list[str] | None = None  # each prompt token's text; None: not known
    output: list[str] | None = None  # each output token's text so far; None: not known
    output_text: str | None = None  # the whole output, when its token boundaries are not known
    note: str = ""  # why some of it is missing


def admitted(r: RequestRow) -> bool:
    """Looked up in the cache (its cached count is known): not waiting, not rejected, not
    cancelled before it ran."""
    if r.cached_tokens > 0:
        return True
    if r.state in ("waiting", "finished: rejected"):
        return False
    return not (r.state == "finished: cancelled" and r.output_tokens == 0)


NO_TEXT = ("This session was recorded without text (the default, for privacy): token counts "
           "and block boundaries only. Record with text to see it here.")


def recorded_text(reader, request_id: int) -> RequestText:
    """A request's text as a session file holds it (a SessionReader)."""
    block_size = reader.meta.block_size
    r = reader.request(request_id)
    if r is None:
        return RequestText(request_id, block_size, note="This request is not in the session.")
    if r.prompt_text is None:
        return RequestText(request_id, block_size, note=NO_TEXT)
    prompt_ends, output_ends = reader.token_ends(request_id)
    if prompt_ends is None or len(prompt_ends) != r.prompt_tokens:
        return RequestText(request_id, block_size, [r.prompt_text], None, r.output_text,
                           "Recorded before kvscope kept token boundaries: the text without "
                           "its cached span or blocks.")
    output = (None if output_ends is None or r.output_text is None
              else split_at(r.output_text, output_ends))
    return RequestText(request_id, block_size, split_at(r.prompt_text, prompt_ends), output,
                       r.output_text if output is None else None)


@dataclass
class Frame:
    """One step's view. `records` and `events` are what is new since the previous frame (the
    timeline and the event log append them); `snapshot` and `requests` are the state at the step
    shown, None when unchanged (new steps arrived while the user looks at an older one)."""

    snapshot: Snapshot | None = None
    evicted: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    records: list[StepRecord] = field(default_factory=list)
    events: list[ev.Event] = field(default_factory=list)
    requests: list[RequestRow] | None = None
    explanations: dict[int, MissExplanation] = field(default_factory=dict)  # newly admitted
    # resident blocks no lookup can reach (an ancestor was evicted), from a source that knows
    # the pool's chain roots; None: not known
    dead: np.ndarray | None = None
    dead_counts: tuple[np.ndarray, np.ndarray] | None = None  # (steps, dead blocks), sampled
    # an attached server's Prometheus numbers: (step, {"kv_usage", "ttft", "itl", ...}), new
    metrics: list[tuple[int, dict]] = field(default_factory=list)
    text: RequestText | None = None  # the watched request's text, when it changed
    # an attached server's identity roots: root key (the parent hash of its chains' first
    # blocks) -> label (LoRA adapter, salt digest); None: not known
    root_names: dict[int, str] | None = None

    @classmethod
    def of_update(cls, update) -> Frame:
        """What one step of the engine's stream (a StepUpdate) adds to a frame."""
        return cls(records=[update.record], events=list(update.events),
                   explanations={why.request_id: why for why in update.explanations})

    def merge(self, later: Frame) -> Frame:
        """This frame followed by a later one, as if the window had taken only the later."""
        self.records.extend(later.records)
        self.events.extend(later.events)
        self.explanations.update(later.explanations)
        self.metrics.extend(later.metrics)
        if later.snapshot is not None:
            self.snapshot, self.evicted, self.dead = later.snapshot, later.evicted, later.dead
        if later.requests is not None:
            self.requests = later.requests
        if later.dead_counts is not None:
            self.dead_counts = later.dead_counts
        if later.text is not None:
            self.text = later.text
        if later.root_names is not None:
            self.root_names = later.root_names
        return self


def evicted_at(events: list[ev.Event], step: int) -> np.ndarray:
    """The blocks evicted by `step`: drawn as "evicted this step" in the pool."""
    return np.asarray([b for e in events if e.kind == ev.EVICTED and e.step == step
                       for b in e.blocks], dtype=np.int64)


@dataclass
class EngineInfo:
    """What the window knows about the engine in the other process."""

    model_name: str
    model_config: dict  # the model's config.json
    device: str  # "cpu", "cuda", ...
    cache_dtype: str  # what the KV cache really stores, e.g. "bfloat16"
    kv_bytes_per_token: int  # measured from the cache tensor
    num_blocks: int
    block_size: int
    history_path: str | None = None  # the session the engine always records (no text)
    chat_template: bool = False  # the model can chat (the composer's chat mode)
    kv_format: str = ""  # the engine's kv_cache_dtype, "auto" resolved ("int4_per_token_head")
    num_steps: int = 0  # steps run so far, as of the latest frame
    explanations: dict[int, MissExplanation] = field(default_factory=dict)

    def explain_miss(self, request_id: int) -> MissExplanation:
        """Why a request's prompt did not fully hit (KeyError: not admitted yet)."""
        return self.explanations[request_id]

    def update(self, frame: Frame) -> None:
        if frame.records:
            self.num_steps = frame.records[-1].step + 1
        self.explanations.update(frame.explanations)
