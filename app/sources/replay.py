"""A session file as a frame source: every step, and the requests' states at each step."""

from __future__ import annotations

from kvscope.app.frames import Frame, RequestRow, evicted_at
from kvscope.app.sources.base import FrameSource
from kvscope.engine import events as ev
from kvscope.engine.explain import MissExplanation
from kvscope.sessions import SessionError, SessionReader

READ_ONLY = "A recorded session cannot be changed: press Back to live to use the engine"
# The events that move a request between waiting, running and finished, and where they lead.
LIFECYCLE = {ev.ARRIVED: "waiting", ev.PREEMPTED: "waiting", ev.ADMITTED: "running",
             ev.FORKED: "running", ev.FINISHED: "finished", ev.CANCELLED: "finished",
             ev.REJECTED: "finished"}


def _cached_of(admitted_detail: str) -> int:
    """The cached tokens an ADMITTED event's detail gives ("336 cached, 1108 to compute")."""
    head = admitted_detail.split(" cached", 1)[0]
    return int(head) if head.isdigit() else 0


class ReplaySource(FrameSource):
    """A session file: every step, the requests' states at that step derived from the
    recorded lifecycle events, and the recorded miss explanations."""

    def __init__(self, reader: SessionReader):
        self.reader = reader
        self.name = reader.path.name
        self.read_only = READ_ONLY
        # (published step, request, kind, detail): a request added between steps N and N+1 is
        # stamped N but published, and replayed, with N+1
        self._lifecycle: list[tuple[int, int, str, str]] = []
        self._read_to = (reader.first_step or 0) - 1
        self._requests = {}
        self._unsent = True
        self._catch_up()

    @classmethod
    def open(cls, path: str) -> ReplaySource:
        """A source whose first step has been read: a bad file raises SessionError here."""
        reader = SessionReader(path)
        try:
            if reader.num_steps == 0:
                raise SessionError(f"{path}: the session has no recorded steps")
            source = cls(reader)
            source.frame_at(reader.first_step)
        except (SessionError, IndexError) as e:
            reader.close()
            raise SessionError(str(e)) from e
        return source

    def _catch_up(self) -> None:
        """Read what was added to the file since (a live history grows)."""
        last = self.reader.last_step
        if last is None or last <= self._read_to:
            return
        self._lifecycle += [(step, e.request_id, e.kind, e.detail) for step, e in
                            self.reader.events_published(self._read_to + 1, last, LIFECYCLE)
                            if e.request_id is not None]
        self._requests = {r.request_id: r for r in self.reader.requests()}
        self._read_to = last

    def take_frame(self) -> Frame | None:
        """Once: every step record and event, for the timeline and the event log."""
        if not self._unsent:
            return None
        self._unsent = False
        r = self.reader
        return Frame(records=r.steps(), events=r.events_between(r.first_step, r.last_step))

    def step_range(self) -> tuple[int, int] | None:
        r = self.reader
        return None if r.num_steps == 0 else (r.first_step, r.last_step)

    def frame_at(self, step: int) -> Frame:
        if step > (self.reader.last_step if self.reader.num_steps else -1):
            self.reader.refresh()
            self._catch_up()
        try:
            snap = self.reader.snapshot_at(step)
        except IndexError as e:
            raise SessionError(str(e)) from e
        return Frame(snapshot=snap, evicted=evicted_at(self.reader.events_at(step), step),
                     requests=self.rows_at(step, snap))

    def rows_at(self, step: int, snap) -> list[RequestRow]:
        """Each request that had arrived by `step`, in its state at the end of that step."""
        last: dict[int, tuple[str, str]] = {}
        admitted: dict[int, int] = {}  # cached tokens at the first admission
        for s, rid, kind, detail in self._lifecycle:
            if s > step:
                break
            last[rid] = (kind, detail)
            if kind == ev.ADMITTED and rid not in admitted:
                admitted[rid] = _cached_of(detail)
        rows = []
        for rid in sorted(last):
            kind, detail = last[rid]
            r = self._requests.get(rid)
            if r is None:
                continue
            state, outputs = LIFECYCLE[kind], 0
            done = state == "finished"
            if state == "running":
                computed = snap.num_computed_tokens.get(rid, 0)
                state = "prefill" if computed < r.prompt_tokens else "decode"
                outputs = computed - r.prompt_tokens + 1 if state == "decode" else 0
            elif done:
                state = f"finished: {detail if kind == ev.FINISHED else kind}"
                outputs = r.output_tokens or 0
            # A request's row is written when it finishes: before, its admission says.
            cached = r.cached_tokens if r.cached_tokens is not None else admitted.get(rid, 0)
            rows.append(RequestRow(
                rid, state, r.prompt_tokens, cached if kind != ev.ARRIVED else 0,
                outputs, r.ttft_s if outputs else None, r.tpot_s if done else None,
                r.salt_digest, r.parent_id, r.output_text or ""))
        return rows

    def explain(self, request_id: int, step: int | None) -> MissExplanation | None:
        return self.reader.explanation(request_id, step)

    def settings(self) -> dict:
        meta = self.reader.meta
        cfg = meta.engine_config
        return {"model": meta.model_name or "?", "num_blocks": meta.num_blocks,
                "block_size": meta.block_size, "kv_cache_dtype": cfg.get("kv_cache_dtype"),
                "enable_prefix_caching": cfg.get("enable_prefix_caching"),
                "policy": cfg.get("eviction_policy")}

    def close(self) -> None:
        self.reader.close()
