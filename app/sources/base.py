"""Frame sources: where the window's frames come from. The window shows one source at a time,
through one path (`MainWindow.show`); panels never know which source it is.

A source answers four things: the frames that are new (`take_frame`), the frame of any step it
keeps (`frame_at`), why a request missed the cache (`explain`), and its settings. `LiveSource`
is the engine process (its history is the session the engine always records); `ReplaySource` is
a session file. A what-if lab run or an attached vLLM server would be a third and a fourth."""

from __future__ import annotations

from kvscope.app.frames import Frame, RequestRow, evicted_at
from kvscope.engine import events as ev
from kvscope.engine.explain import MissExplanation
from kvscope.sessions import SessionError, SessionReader

MAX_EVENTS = 20_000  # events kept to show again (the event log keeps as many)
READ_ONLY = "A recorded session cannot be changed: press Back to live to use the engine"
# The events that move a request between waiting, running and finished, and where they lead.
LIFECYCLE = {ev.ARRIVED: "waiting", ev.PREEMPTED: "waiting", ev.ADMITTED: "running",
             ev.FORKED: "running", ev.FINISHED: "finished", ev.CANCELLED: "finished",
             ev.REJECTED: "finished"}


def _cached_of(admitted_detail: str) -> int:
    """The cached tokens an ADMITTED event's detail gives ("336 cached, 1108 to compute")."""
    head = admitted_detail.split(" cached", 1)[0]
    return int(head) if head.isdigit() else 0


class FrameSource:
    name = ""  # for the status bar
    read_only: str | None = None  # why submitting and cancelling are off (None: they are on)
    live = False  # has a newest step that moves on (the window can follow it)

    def take_frame(self) -> Frame | None:
        """What is new since the last call (None: nothing)."""
        return None

    def step_range(self) -> tuple[int, int] | None:
        """The first and last step `frame_at` can show (None: none yet)."""
        return None

    def frame_at(self, step: int) -> Frame:
        """The state at the end of `step` (raises SessionError if it cannot be shown)."""
        raise SessionError("this source keeps no history")

    def explain(self, request_id: int, step: int | None) -> MissExplanation | None:
        """Why the request missed the prefix cache, as of `step` (None: the newest)."""
        return None

    def settings(self) -> dict:
        """model, num_blocks, block_size, kv_cache_dtype, enable_prefix_caching, policy."""
        return {}

    def close(self) -> None:
        pass


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


class LiveSource(FrameSource):
    """The engine process. Its frames stream in; past steps come from the session it always
    records (`EngineInfo.history_path`)."""

    live = True

    def __init__(self, client):
        self.client = client
        self.name = "live"
        self._history: ReplaySource | None = None
        self.reset()

    def reset(self) -> None:
        """A new engine: nothing shown yet."""
        if self._history is not None:
            self._history.close()
        self._history = None
        self.latest = Frame()  # the newest state, and every record and event so far
        self.latest.requests = []

    def take_frame(self) -> Frame | None:
        frame = self.client.take_frame()
        if frame is not None:
            self.latest.merge(Frame(frame.snapshot, frame.evicted, list(frame.records),
                                    list(frame.events), frame.requests))
            del self.latest.events[:-MAX_EVENTS]
        return frame

    def everything(self) -> Frame:
        """The newest state with every record and event so far (to show this source again)."""
        f = self.latest
        return Frame(f.snapshot, f.evicted, list(f.records), list(f.events), f.requests)

    def newest(self) -> Frame:
        """The newest state, nothing new."""
        return Frame(self.latest.snapshot, self.latest.evicted, requests=self.latest.requests)

    def step_range(self) -> tuple[int, int] | None:
        records = self.latest.records
        return (records[0].step, records[-1].step) if records else None

    def history(self) -> ReplaySource:
        info = self.client.info
        if info is None or info.history_path is None:
            raise SessionError("this engine keeps no history: only the newest step is shown")
        if self._history is None or str(self._history.reader.path) != info.history_path:
            if self._history is not None:
                self._history.close()
            self._history = ReplaySource(SessionReader(info.history_path))
        return self._history

    def frame_at(self, step: int) -> Frame:
        history = self.history()
        try:
            return history.frame_at(step)
        except SessionError:
            written = history.step_range()
            if written is None or step > written[1]:  # the recorder commits every ~0.25 s
                raise SessionError(f"step {step} is not in the engine's history yet; try again "
                                   "in a moment") from None
            raise

    def explain(self, request_id: int, step: int | None) -> MissExplanation | None:
        info = self.client.info
        if step is None and info is not None:
            return info.explanations.get(request_id)
        return self.history().explain(request_id, step)

    def settings(self) -> dict:
        info = self.client.info
        if info is None:
            return {}
        return {"model": info.model_name, "num_blocks": info.num_blocks,
                "block_size": info.block_size, "kv_cache_dtype": info.cache_dtype}

    def close(self) -> None:
        self.reset()


ATTACHED_READ_ONLY = ("An attached server's cache is shown, not changed: File → Detach returns "
                      "to the engine")


class AttachSource(FrameSource):
    """A vLLM or SGLang server's KV events (or `kvscope serve --kv-events`): its cache mirrored
    as hash slots (physical block ids are not published), one step per tick, on a thread of its
    own (`AttachSession`). Problems (nothing arrives, not KV events, metrics unreadable) go to
    `on_problem` one line each; the last `HISTORY` steps can be looked at again."""

    live = True
    attached = True

    def __init__(self, endpoint: str, replay: str | None = None, topic: str = "",
                 metrics: str | None = None, record: str | None = None, **options):
        """Raises ValueError with a one-line message for an address that cannot be used."""
        from kvscope.sessions.kv_events.session import AttachSession

        self.session = AttachSession(endpoint, replay or None, topic, metrics or None,
                                     record or None, **options)
        self.name = endpoint
        self.record_path = record or None
        self.read_only = ATTACHED_READ_ONLY
        self.on_problem = None  # called with each problem, one line
        self.session.start()

    def take_frame(self) -> Frame | None:
        s = self.session
        for problem in s.take_problems():
            if self.on_problem is not None:
                self.on_problem(problem)
        updates, metrics = s.take_updates()
        if not updates:
            return None
        with s.lock:
            snap, roots = s.latest, s.root_names
        events = [e for u in updates for e in u.events]
        del events[:-MAX_EVENTS]
        return Frame(snapshot=snap, evicted=evicted_at(events, snap.step),
                     records=[u.record for u in updates], events=events, requests=[],
                     metrics=metrics, root_names=roots)

    def newest(self) -> Frame:
        with self.session.lock:
            snap, roots = self.session.latest, self.session.root_names
        return Frame(snapshot=snap, requests=[], root_names=roots)

    everything = newest  # what was shown before stays in the panels that keep history

    def step_range(self) -> tuple[int, int] | None:
        with self.session.lock:
            kept = list(self.session.history)
        return (kept[0][0], kept[-1][0]) if kept else None

    def frame_at(self, step: int) -> Frame:
        with self.session.lock:
            kept = dict(self.session.history)
        if step not in kept:
            raise SessionError(f"step {step} is no longer kept (an attached session keeps its "
                               f"last {len(kept)} steps; a recording keeps all of them)")
        return Frame(snapshot=kept[step], requests=[])

    def health(self) -> tuple[str, list[str], bool]:
        """(one line for the status bar, every line, True when nothing was missed)."""
        s = self.session
        with s.lock:
            return s.health_short, list(s.health_lines), s.healthy

    def describe_slot(self, slot: int) -> str:
        """What a hash slot of the pool view holds, as the mirror knows it now."""
        try:
            text = self.session.slots.describe(slot)
        except (KeyError, RuntimeError):  # changed under us by the attach thread: ask again
            text = None
        return text or f"hash slot {slot}: empty (no block hash in it now)"

    def status_text(self, snap) -> str:
        hit = f" · hit {snap.token_hit_rate:.0%} (metrics)" if snap.query_tokens else ""
        return (f"attached · {self.name} · {snap.num_cached_blocks} resident blocks in "
                f"{snap.num_blocks} hash slots · step {snap.step}{hit}")

    def settings(self) -> dict:
        cfg = self.session.slots.config
        return {"model": f"attached: {self.name}", "num_blocks": cfg.num_blocks,
                "block_size": cfg.block_size, "kv_cache_dtype": None,
                "enable_prefix_caching": True, "policy": None}

    def close(self) -> None:
        self.session.stop()
