"""An attached session: subscriptions, the mirror, its hash slots, metrics and a recording,
driven in ticks (one step each) on the caller's thread (`run`) or a thread of its own (`start`).

    s = AttachSession("tcp://HOST:5557", replay="tcp://HOST:5558", metrics="http://HOST:8000/metrics",
                      record="attached.kvscope")
    s.run(duration_s=10)        # headless; or s.start() ... s.stop() beside a window
    print(s.summary())

What a window needs is read under `lock`: `latest` (the newest snapshot), `take_updates()`,
`health_short`/`health_lines`/`healthy` (None while nothing has arrived), `take_problems()` (one
line each, for a banner) and `take_resolved()` (the problems said that no longer hold).
"""

from __future__ import annotations

import threading
import time
from collections import deque

import zmq

from kvscope.sessions.kv_events.metrics import MetricsError, MetricsScraper
from kvscope.sessions.kv_events.mirror import Mirror
from kvscope.sessions.kv_events.slots import DEFAULT_SLOTS, HashSlots, group_lines, tier_lines
from kvscope.sessions.kv_events.subscriber import Attachment, rank_endpoint

TICK_S = 0.25  # one step per tick
METRICS_EVERY_S = 1.0
SILENT_S = 5.0  # no KV event by then: say so
HISTORY = 64  # snapshots kept for looking back


class AttachSession:
    def __init__(self, endpoint: str, replay: str | None = None, topic: str = "",
                 metrics: str | None = None, record: str | None = None, dp_ranks: int = 1,
                 num_slots: int = DEFAULT_SLOTS, parity=None, tick_s: float = TICK_S,
                 overwrite: bool = False, silent_s: float | None = None):
        """Raises ValueError (MetricsError included) for an address that cannot be used."""
        self._begin(endpoint, record, tick_s, overwrite, silent_s)
        self.mirror = Mirror(parity)
        self.scraper = MetricsScraper(metrics) if metrics else None
        try:
            for r in range(dp_ranks):
                self.attachments.append(Attachment(
                    rank_endpoint(endpoint, r), rank_endpoint(replay, r) if replay else None,
                    topic, self.mirror))
        except ValueError:
            self.close()
            raise
        self.slots = HashSlots(self.mirror, num_slots, name=endpoint, endpoint=endpoint,
                               replay=replay, topic=topic, metrics=metrics)

    def _begin(self, name: str, record: str | None, tick_s: float, overwrite: bool,
               silent_s: float | None) -> None:
        """What every attached session starts with, before its mirror and streams."""
        self.endpoint, self.record_path, self.overwrite = name, record, overwrite
        self.tick_s, self.silent_s = tick_s, SILENT_S if silent_s is None else silent_s
        self.recorder = None
        self._layout: tuple = ()  # the slots' tiers and forms at the last tick (slots.layout)
        self._closed = False
        self.attachments: list[Attachment] = []
        self.lock = threading.Lock()
        self.latest = None  # the newest Snapshot
        self.history: deque = deque(maxlen=HISTORY)  # (step, Snapshot)
        self._updates: list = []  # StepUpdates not taken yet
        self._metrics: list[tuple[int, dict]] = []  # (step, metrics delta) not taken yet
        self._problems: list[str] = []
        self._said: dict[str, str] = {}  # key -> the problem said
        self._resolved: list[str] = []
        self.health_short, self.health_lines = "mirror: waiting for events", []
        self.healthy: bool | None = None  # True: nothing missed; None: nothing arrived yet
        self.root_names: dict[int, str] = {}  # the tree's identity roots -> labels (slots.roots)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = False
        self._t0 = time.monotonic()
        self._last_metrics = -METRICS_EVERY_S
        self.metrics_summary: dict[str, float] = {}  # the newest gauges and interval means

    # ------------------------------------------------------------------ driving
    def run(self, duration_s: float | None = None) -> None:
        """Tick until duration_s has passed or stop() (on this thread)."""
        self._start_streams()
        poller = zmq.Poller()
        for a in self.attachments:
            for sock in a.sockets:  # live messages and connection events
                poller.register(sock, zmq.POLLIN)

        def wait(seconds: float) -> None:
            poller.poll(int(seconds * 1000) + 1)
            for a in self.attachments:  # what arrived, or a replay retry that is due
                a.poll(0)

        self._ticks(duration_s, wait)
        for a in self.attachments:  # what arrived by the end is applied and shown
            a.poll(0)
        self.tick(self.tick_s)

    def _ticks(self, duration_s: float | None, wait) -> None:
        """Tick every tick_s until duration_s has passed or stop(); `wait(seconds)` between."""
        deadline = None if duration_s is None else time.monotonic() + duration_s
        next_tick = time.monotonic() + self.tick_s
        while not self._stop.is_set():
            now = time.monotonic()
            end = next_tick if deadline is None else min(next_tick, deadline)
            wait(max(0.0, end - now))
            now = time.monotonic()
            if now >= next_tick:
                self.tick(now - next_tick + self.tick_s)
                next_tick = max(next_tick + self.tick_s, now)
            if deadline is not None and now >= deadline:
                break

    def start(self) -> AttachSession:
        """Run on a thread of its own until stop()."""
        self._thread = threading.Thread(target=self._run_safely, name="kvscope-attach",
                                        daemon=True)
        self._thread.start()
        return self

    def _run_safely(self) -> None:
        try:
            self.run()
        except Exception as e:  # noqa: BLE001 - said in the window's banner, never a traceback
            self._problem(f"the attachment stopped: {type(e).__name__}: {e}")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.recorder is not None:
            status = self.recorder.close()
            if status.error:
                self._problem(f"recording {self.record_path} stopped: {status.error}")
        for a in self.attachments:
            a.close()

    def _start_streams(self) -> None:
        if self._started:
            return
        self._started = True
        for a in self.attachments:
            a.start()  # history from the replay endpoint, when given

    # ------------------------------------------------------------------ a tick
    def tick(self, wall_s: float) -> None:
        now = time.monotonic()
        metrics = self._scrape(now)
        if self.record_path and self.recorder is None and self.slots.learn_block_size():
            self._start_recording()
        if self.recorder is not None and self.slots.layout() != self._layout:
            self.recorder.keyframe_next()  # its replay starts from a keyframe that has them
        self._layout = self.slots.layout()
        update = self.slots.tick(now - wall_s, wall_s, metrics)
        snap = self.slots.snapshot()
        roots = self.slots.roots()
        self._check(now)
        with self.lock:
            self.latest = snap
            self.history.append((snap.step, snap))
            self._updates.append(update)
            if metrics:
                self._metrics.append((update.record.step, metrics))
            self.health_short, self.healthy = self._short_health()
            self.health_lines = self._health_lines() + self._slot_lines() + \
                group_lines(snap) + tier_lines(snap)
            self.root_names = roots

    def _scrape(self, now: float) -> dict | None:
        """The metrics delta of this tick (None: not scraped in it)."""
        if self.scraper is None or now - self._last_metrics < METRICS_EVERY_S:
            return None
        self._last_metrics = now
        metrics = self.scraper.poll()
        if self.scraper.error:
            self._problem(f"Metrics: {self.scraper.error}")
        elif metrics:
            self.metrics_summary.update(
                {k: v for k, v in metrics.items() if k not in ("hits", "queries", "preemptions")})
        return metrics

    def _health_lines(self) -> list[str]:
        return self.mirror.health.lines()

    def _start_recording(self) -> None:
        from kvscope.sessions.recorder import Recorder  # sqlite only when recording

        try:
            self.recorder = Recorder(self.record_path, self.slots, overwrite=self.overwrite,
                                     raw_hashes=True).start()
        except (OSError, ValueError) as e:
            self._problem(f"cannot record to {self.record_path}: {e}")
            self.record_path = None

    def _check(self, now: float) -> None:
        h = self.mirror.health
        if not h.first_seq and now - self._t0 >= self.silent_s:
            got = sum(a.num_messages for a in self.attachments)
            self._problem(
                f"No KV events from {self.endpoint} after {self.silent_s:g} s ({got} messages): "
                "is the server publishing (--kv-events-config with \"publisher\": \"zmq\"), and "
                "are the address and topic right? Still listening.", key="silent")
        elif h.first_seq and self._said.get("silent"):  # events came after all
            with self.lock:
                self._resolved.append(self._said["silent"])
            self._said["silent"] = ""  # said and resolved: never said again
        if h.bad_messages:
            last = h.notes[-1] if h.notes else ""
            self._problem(f"{self.endpoint} sends messages that are not KV events "
                          f"(is it a vLLM/SGLang KV-event publisher?): {last}", key="bad")

    def _problem(self, text: str, key: str | None = None) -> None:
        key = key or text
        if key not in self._said:
            self._said[key] = text
            with self.lock:
                self._problems.append(text)

    def _short_health(self) -> tuple[str, bool | None]:
        h = self.mirror.health
        lost = trouble(h) + self.slots.num_overflow
        if not h.first_seq:  # nothing missed, nothing arrived either: not healthy yet
            return "mirror: no events yet", None if h.bad_messages == 0 else False
        late = [s for s in h.first_seq.values() if s > 0]
        coverage = "from seq 0" if not late else f"from seq {min(late)}"
        return (f"mirror: gaps {h.gaps} (repaired {h.repaired}) · replayed {h.replayed} · "
                f"history {coverage} · orphans {h.orphans + h.orphan_removes} · "
                f"dup {h.duplicate_stores} · "
                f"restarts {h.restarts}" + (f" · bad {h.bad_messages}" if h.bad_messages else "")
                + (" · disconnected: may have missed batches" if h.unsure else "")
                + (f" · group spec conflicts {h.spec_conflicts}" if h.spec_conflicts else ""),
                lost == 0 and not late)

    def _slot_lines(self) -> list[str]:
        s = self.slots
        lines = [f"hash slots: {s.pool.num_cached} of {s.num_blocks} in use (physical block ids "
                 "are not published: a cell is a hash, not a block)"]
        if s.num_overflow:
            lines.append(f"slot view full: {s.num_overflow} resident blocks pushed out "
                         "(attach with more slots)")
        return lines

    # ------------------------------------------------------------------ readers
    def take_updates(self) -> tuple[list, list]:
        """(StepUpdates, (step, metrics delta)) since the last call."""
        with self.lock:
            updates, self._updates = self._updates, []
            metrics, self._metrics = self._metrics, []
        return updates, metrics

    def take_problems(self) -> list[str]:
        with self.lock:
            problems, self._problems = self._problems, []
        return problems

    def take_resolved(self) -> list[str]:
        """The problems said (take_problems) that no longer hold, since the last call."""
        with self.lock:
            resolved, self._resolved = self._resolved, []
        return resolved

    def summary(self) -> str:
        lines = self.mirror.summary().splitlines()
        extra = self._slot_lines()[1:]
        if self.scraper is not None:
            sc = self.scraper
            if sc.last is None:
                extra.append(f"metrics: {sc.error or 'not scraped'}")
            else:
                extra.append("metrics: " + metrics_line(sc.last) +
                             (f" (last scrape failed: {sc.error})" if sc.error else ""))
        if self.record_path:
            extra.append(f"recorded: {self.record_path}" if self.recorder is not None else
                         f"not recorded: no KV events arrived ({self.record_path})")
        return "\n".join(lines[:-1] + extra + lines[-1:])  # the counts line stays the last


def trouble(h) -> int:
    """How many things a Health counts that make a mirror untrustworthy (0: none)."""
    return h.lost + h.bad_messages + h.restarts + h.orphans + h.orphan_removes + \
        len(h.unsure) + h.spec_conflicts


def metrics_line(p) -> str:
    parts = []
    if p.queries is not None and p.hits is not None:
        rate = f" ({p.hits / p.queries:.1%})" if p.queries else ""
        parts.append(f"prefix cache hits {p.hits:.0f} of {p.queries:.0f} tokens{rate}")
    elif p.hit_rate is not None:
        parts.append(f"prefix cache hit rate {p.hit_rate:.1%}")
    if p.kv_usage is not None:
        parts.append(f"KV usage {p.kv_usage:.1%}")
    if p.preemptions is not None:
        parts.append(f"preemptions {p.preemptions:.0f}")
    for name, hist in (("TTFT", p.ttft), ("ITL", p.itl)):
        if hist is not None and hist[1]:
            parts.append(f"{name} mean {hist[0] / hist[1] * 1e3:.1f} ms over {hist[1]:.0f}")
    return ", ".join(parts) or "nothing kvscope uses"


__all__ = ["AttachSession", "MetricsError", "metrics_line"]
