"""A session file as a frame source: every step, and the requests' states at each step."""

from __future__ import annotations

from kvscope.app.frames import Frame, RequestRow, evicted_at
from kvscope.app.sources.base import FrameSource
from kvscope.engine import events as ev
from kvscope.engine.explain import MissExplanation
from kvscope.engine.kv_format_spec import block_format
from kvscope.engine.lifecycle import LIFECYCLE_KINDS, RUNNING, Lifecycles
from kvscope.sessions import SessionError, SessionReader

READ_ONLY = "A recorded session cannot be changed: press Back to live to use the engine"
class ReplaySource(FrameSource):
    """A session file: every step, the requests' states at that step derived from the
    recorded lifecycle events, and the recorded miss explanations."""

    def __init__(self, reader: SessionReader):
        self.reader = reader
        self.name = f"{reader.path.name} · {reader.meta.model_name or '?'}"
        self.read_only = READ_ONLY
        # (published step, event) of the lifecycle kinds: a request added between steps N and
        # N+1 is stamped N but published, and replayed, with N+1
        self._lifecycle: list[tuple[int, ev.Event]] = []
        self._read_to = (reader.first_step or 0) - 1
        self._requests = {}
        # a host tier's loads: request -> (step, blocks loaded in it); and the tokens each
        # request loaded from the host at its first admission (its cached tokens' host part)
        self._loads: dict[int, tuple[int, dict[int, int]]] = {}
        self._host_tokens: dict[int, int] = {}
        self._host_blocks: int | None = None
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
        read = [(step, e) for step, e in self.reader.events_published(
            self._read_to + 1, last, LIFECYCLE_KINDS | {ev.LOADED}) if e.request_id is not None]
        self._fold_loads(e for _, e in read)
        self._lifecycle += [(step, e) for step, e in read if e.kind != ev.LOADED]
        self._requests = {r.request_id: r for r in self.reader.requests()}
        self._read_to = last

    def _fold_loads(self, events) -> None:
        """A request's cached tokens loaded from the host tier: the blocks its LOADED events
        copied back in the step of its first ADMITTED (both come from the same admission), as
        the engine counts RequestMetrics.host_cached_tokens (with KV-cache groups: the group
        that loaded most blocks)."""
        loads, host, bs = self._loads, self._host_tokens, self.reader.meta.block_size
        for e in events:
            rid = e.request_id
            if e.kind == ev.LOADED:
                st, per_group = loads.get(rid, (e.step, {}))
                per_group = per_group if st == e.step else {}
                per_group[e.group] = per_group.get(e.group, 0) + len(e.blocks) // 2
                loads[rid] = (e.step, per_group)
            elif e.kind == ev.ADMITTED and rid not in host:
                st, per_group = loads.get(rid, (None, {}))
                host[rid] = max(per_group.values(), default=0) * bs if st == e.step else 0

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
        lifecycles = Lifecycles()
        for s, e in self._lifecycle:
            if s > step:
                break
            lifecycles.apply(e)
        rows = []
        for rid in sorted(lifecycles.requests):
            life = lifecycles.requests[rid]
            r = self._requests.get(rid)
            if r is None:
                continue
            state, outputs = life.status, 0
            if state == RUNNING:
                computed = snap.num_computed_tokens.get(rid, 0)
                state = "prefill" if computed < r.prompt_tokens else "decode"
                outputs = computed - r.prompt_tokens + 1 if state == "decode" else 0
            elif life.finished:
                state = f"finished: {life.reason}"
                outputs = r.output_tokens or 0
            # A request's row is written when it finishes: before, its admission says (a forked
            # sample's, its parent's: it is never admitted, it shares its parent's prompt).
            parent = lifecycles.get(r.parent_id) if r.parent_id is not None else None
            looked_up = parent if parent is not None and not life.admitted else life
            cached = looked_up.cached_tokens if r.cached_tokens is None else r.cached_tokens
            host = self._host_tokens.get(looked_up.request_id, 0)
            rows.append(RequestRow.new(
                rid, state, r.prompt_tokens, cached_tokens=0 if life.just_arrived else cached,
                host_cached_tokens=0 if life.just_arrived else host,
                output_tokens=outputs, ttft_s=r.ttft_s if outputs else None,
                tpot_s=r.tpot_s if life.finished else None, cache_salt=r.salt_digest,
                parent_id=r.parent_id, text=r.output_text or ""))
        return rows

    def explain(self, request_id: int, step: int | None) -> MissExplanation | None:
        return self.reader.explanation(request_id, step)

    def settings(self) -> dict:
        meta = self.reader.meta
        cfg = meta.engine_config
        return {"model": meta.model_name or "?", "num_blocks": meta.num_blocks,
                "block_size": meta.block_size, "kv_cache_dtype": cfg.get("kv_cache_dtype"),
                "enable_prefix_caching": cfg.get("enable_prefix_caching"),
                "policy": cfg.get("eviction_policy"), "host_blocks": self.host_blocks(),
                "kv_bytes_per_token": meta.kv_bytes_per_token, "kv_format": self.kv_format()}

    def kv_format(self) -> str:
        """The blocks' format, from the engine config (a session from before the formats: its
        kv_cache_dtype; "auto" is the model's dtype, float32 on the CPU unless the config
        names one)."""
        meta = self.reader.meta
        cfg = meta.engine_config
        cpu = "float32" if str(meta.device).startswith("cpu") else None
        return block_format(str(cfg.get("kv_cache_dtype") or "auto"), cfg.get("dtype") or cpu)

    def host_blocks(self) -> int:
        """The host tier's blocks (0: none), as the first step's snapshot holds it (a tier
        sized in bytes has no host_blocks in its config)."""
        if self._host_blocks is None:
            host = self.reader.snapshot_at(self.reader.first_step).host
            self._host_blocks = 0 if host is None else host.num_blocks
        return self._host_blocks

    def close(self) -> None:
        self.reader.close()
