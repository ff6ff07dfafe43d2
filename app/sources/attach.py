"""An attached vLLM or SGLang server (or `kvscope serve --kv-events`) as a frame source."""

from __future__ import annotations

from kvscope.app.frames import Frame, evicted_at
from kvscope.app.sources.base import MAX_EVENTS, FrameSource
from kvscope.sessions import SessionError

ATTACHED_READ_ONLY = ("An attached server's cache is shown, not changed: File → Detach returns "
                      "to the engine")


class AttachSource(FrameSource):
    """A vLLM or SGLang server's KV events (or `kvscope serve --kv-events`): its cache mirrored
    as hash slots (physical block ids are not published), one step per tick, on a thread of its
    own (`AttachSession`). Problems (nothing arrives, not KV events, metrics unreadable) go to
    `on_problem` one line each, and to `on_resolved` once they no longer hold (events came
    after all); the last `HISTORY` steps can be looked at again."""

    live = True
    attached = True

    def __init__(self, endpoint: str, replay: str | None = None, topic: str = "",
                 metrics: str | None = None, record: str | None = None, **options):
        """Raises ValueError with a one-line message for an address that cannot be used."""
        from kvscope.sessions.kv_events.session import AttachSession

        self._init(AttachSession(endpoint, replay or None, topic, metrics or None,
                                 record or None, **options), record)

    def _init(self, session, record: str | None) -> None:
        self.session = session
        self.name = session.endpoint
        self.record_path = record or None
        self.read_only = ATTACHED_READ_ONLY
        self.on_problem = None  # called with each problem, one line
        self.on_resolved = None  # called with a problem said before that no longer holds
        self.session.start()

    def take_frame(self) -> Frame | None:
        s = self.session
        for said, tell in ((s.take_problems(), self.on_problem),
                           (s.take_resolved(), self.on_resolved)):
            for problem in said:
                if tell is not None:
                    tell(problem)
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

    def health(self) -> tuple[str, list[str], bool | None]:
        """(one line for the status bar, every line, True when nothing was missed; None while
        nothing has arrived)."""
        s = self.session
        with s.lock:
            return s.health_short, list(s.health_lines), s.healthy

    def describe_slot(self, slot: int, tier: str = "GPU") -> str:
        """What a hash slot of a tier's grid holds, as the mirror knows it now."""
        try:
            text = self.session.slots.describe(slot, tier)
        except (KeyError, RuntimeError):  # changed under us by the attach thread: ask again
            text = None
        return text or f"{'' if tier == 'GPU' else tier + ' '}hash slot {slot}: empty (no " \
            "block hash in it now)"

    def status_text(self, snap) -> str:
        hit = f" · hit {snap.token_hit_rate:.0%} (metrics)" if snap.query_tokens else ""
        groups = f" · {len(snap.groups)} KV groups" if len(snap.groups) > 1 else ""
        tiers = "".join(f" · {t.medium} {t.num_cached_blocks}" for t in snap.tiers()[1:])
        return (f"attached · {self.name} · {snap.num_cached_blocks} resident blocks in "
                f"{snap.num_blocks} hash slots{tiers}{groups} · step {snap.step}{hit}")

    def settings(self) -> dict:
        cfg = self.session.slots.config
        return {"model": f"attached: {self.name}", "num_blocks": cfg.num_blocks,
                "block_size": cfg.block_size, "kv_cache_dtype": None,
                "enable_prefix_caching": True, "policy": None}

    def close(self) -> None:
        self.session.stop()
