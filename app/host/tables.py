"""What the engine process keeps for its frames, from the step stream alone: the requests
table (folded by engine.lifecycle) and counts sampled over time."""

from __future__ import annotations

import numpy as np

from kvscope.app.frames import RequestRow
from kvscope.engine.lifecycle import FINISHED, RUNNING, Lifecycle, Lifecycles


class RequestTable:
    """The requests table, kept from the step stream alone (folded by engine.lifecycle): one
    row per request in arrival order, each in the state it is in after the step (prefill:
    prompt tokens still to compute; decode: it has sampled); finished rows beyond `history` are
    dropped, oldest first. Each request's prompt and output token ids are kept beside its row
    (never sent: the text view asks for one request's text)."""

    def __init__(self, history: int = 1024):
        self.rows: dict[int, RequestRow] = {}
        self.tokens: dict[int, tuple[list[int], list[int]]] = {}  # (prompt ids, output ids)
        self.history = history
        self.lifecycles = Lifecycles()
        self._finished: list[int] = []

    def apply(self, update) -> None:
        rows = self.rows
        for r in update.new_requests:
            if r.request_id in rows:  # already shown: submitted between steps
                continue
            life = self.lifecycles.arrive(r.request_id, r.parent_id)
            rows[r.request_id] = RequestRow.new(
                r.request_id, live_state(life), len(r.prompt_token_ids),
                cache_salt=r.cache_salt, parent_id=r.parent_id)
            self.tokens[r.request_id] = (r.prompt_token_ids, [])
        for e in update.events:
            if e.request_id in rows and (life := self.lifecycles.apply(e)) is not None:
                rows[e.request_id].state = live_state(life)
        for o in update.outputs:
            self.set_output(o)
        if len(self._finished) > self.history:
            drop, self._finished = (self._finished[:-self.history],
                                    self._finished[-self.history:])
            for rid in drop:
                rows.pop(rid, None)
                self.tokens.pop(rid, None)
                self.lifecycles.forget(rid)

    def set_output(self, o) -> None:
        """A request's state from its RequestOutput (after a step, or a submit or cancel
        between steps)."""
        life, finished_now = self.lifecycles.output(o)
        row = self.rows.get(o.request_id)
        if row is None:
            row = self.rows[o.request_id] = RequestRow.new(
                o.request_id, "waiting", len(o.prompt_token_ids or ()),
                cache_salt=o.cache_salt, parent_id=o.parent_id)
        prompt = self.tokens.get(o.request_id, (o.prompt_token_ids or [], []))[0]
        self.tokens[o.request_id] = (prompt, o.token_ids)  # a fresh list per output
        m = o.metrics
        row.cached_tokens, row.output_tokens, row.text = (o.num_cached_tokens, len(o.token_ids),
                                                          o.text)
        row.ttft_s, row.tpot_s = m.ttft_s, m.tpot_s
        row.host_cached_tokens = m.host_cached_tokens
        row.state = live_state(life)
        if finished_now:
            self._finished.append(o.request_id)


def live_state(life: Lifecycle) -> str:
    """A live request's state as its row shows it: waiting, prefill (running, not sampled since
    it last computed a prompt chunk), decode, or "finished: <reason>"."""
    if life.status == FINISHED:
        return f"finished: {life.reason}"
    if life.status == RUNNING:
        return "decode" if life.sampled else "prefill"
    return "waiting"


class SampledCounts:
    """(step, count) at each frame sent: at most about `limit` points, every other one dropped
    when there are more, so a long run keeps its whole span at a coarser grain."""

    def __init__(self, limit: int = 4096):
        self.steps: list[int] = []
        self.counts: list[int] = []
        self.limit = limit

    def add(self, step: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        if self.steps and self.steps[-1] == step:
            self.counts[-1] = count
        else:
            self.steps.append(step)
            self.counts.append(count)
        if len(self.steps) > self.limit:
            self.steps, self.counts = self.steps[::2], self.counts[::2]
        return np.array(self.steps), np.array(self.counts)
