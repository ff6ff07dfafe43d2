"""A fleet attached at once: one subscriber per instance, each on a thread of its own (a replay
that does not answer, a scrape that hangs or a flood from one instance never holds up the
others), each with its own health, hash parity and metrics, all mirrored into one Mirror under
one rank per instance, shown and recorded as one session of hash slots (instances as ranks, their
names in the recording's config, each block event's and restart's instance in its detail: see
slots.py).

    s = FleetSession(read_fleet("fleet.txt"), record="fleet.kvscope")
    s.run(10)                 # or start() ... stop() beside a window
    s.rows                    # one InstanceRow per instance, after each tick
    s.index.holders(0, h)     # which instances hold a block hash (kv_events.fleet.FleetIndex)
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from kvscope.sessions.kv_events.fleet import FleetIndex, Instance, check_fleet, mirror_digest
from kvscope.sessions.kv_events.metrics import MetricsScraper
from kvscope.sessions.kv_events.mirror import Health, Mirror
from kvscope.sessions.kv_events.session import (
    HISTORY,
    TICK_S,
    AttachSession,
    metrics_line,
    trouble,
)
from kvscope.sessions.kv_events.slots import DEFAULT_SLOTS, TOP, HashSlots
from kvscope.sessions.kv_events.subscriber import Attachment

POLL_MS = 50  # an instance's thread waits this long for a message before looking around


@dataclass
class InstanceRow:
    """One instance as the fleet table shows it."""

    name: str
    endpoint: str
    resident: int  # blocks its mirror holds (every group and tier)
    ok: bool | None  # True: nothing missed; None: nothing arrived yet; False: see health
    restarts: int
    hit_rate: float | None  # prefix-cache token hit rate from its metrics (None: not scraped)
    kv_usage: float | None  # KV usage fraction from its metrics
    parity: str  # "", or how its hashes differ from the ones recomputed from its tokens
    health: list[str]


def light(h: Health) -> bool | None:
    """An instance's health light: None while nothing arrived (False if only garbage did)."""
    if not h.first_seq:
        return None if not h.bad_messages else False
    return trouble(h) == 0 and not any(s > 0 for s in h.first_seq.values())


def hit_rate(point) -> float | None:
    if point is None:
        return None
    if point.queries:
        return point.hits / point.queries
    return point.hit_rate


class FleetSession(AttachSession):
    def __init__(self, instances: list[Instance], topic: str = "", record: str | None = None,
                 num_slots: int = DEFAULT_SLOTS, parities: list | None = None,
                 tick_s: float = TICK_S, overwrite: bool = False, silent_s: float | None = None,
                 replay_timeout_s: float = 1.0):
        """Raises ValueError (MetricsError included) for an address that cannot be used."""
        check_fleet(instances)
        self.instances = list(instances)
        self.names = [i.name for i in instances]
        self._begin(f"fleet of {len(instances)}", record, tick_s, overwrite, silent_s)
        self._halt = threading.Event()
        self._drivers: list[threading.Thread] = []
        self.mirror = Mirror()
        self.mirror_lock = threading.Lock()  # the instances' threads apply, the tick reads
        self.scraper = None
        self.scrapers = [MetricsScraper(i.metrics) if i.metrics else None for i in instances]
        self.points: list = [None] * len(instances)  # each instance's latest MetricsPoint
        self._deltas: list[dict] = []  # metrics deltas not ticked yet (any instance)
        for rank, _ in enumerate(instances):
            self.mirror.healths[rank] = Health()
            if parities is not None:
                self.mirror.parities[rank] = parities[rank]
        try:
            for rank, inst in enumerate(instances):
                self.attachments.append(Attachment(
                    inst.endpoint, inst.replay, topic, self.mirror, replay_timeout_s,
                    rank=rank, lock=self.mirror_lock))
        except ValueError:
            self.close()
            raise
        self.slots = HashSlots(self.mirror, num_slots, name=self.endpoint,
                               endpoint=" ".join(i.endpoint for i in instances), topic=topic,
                               instances=tuple(self.names))
        self.index = FleetIndex(self.mirror, self.names)
        self.rows: list[InstanceRow] = []
        self._restarts_seen = [0] * len(instances)  # each instance's restarts by the last tick
        # step -> tier -> each slot's rank (-1: empty), for the snapshots kept in `history`
        self.slot_ranks: dict[int, dict[str, np.ndarray]] = {}

    # ------------------------------------------------------------------ driving
    def run(self, duration_s: float | None = None) -> None:
        """Tick until duration_s has passed or stop(); each instance on a thread of its own."""
        self._halt.clear()
        self._drivers = [threading.Thread(target=self._drive, args=(rank,), daemon=True,
                                          name=f"kvscope-fleet-{name}")
                         for rank, name in enumerate(self.names)]
        for t in self._drivers:
            t.start()
        try:
            self._ticks(duration_s, self._stop.wait)
        finally:
            self._halt.set()
            for t in self._drivers:
                t.join(timeout=5.0)
        self.tick(self.tick_s)

    def _drive(self, rank: int) -> None:
        a, scraper, name = self.attachments[rank], self.scrapers[rank], self.names[rank]
        next_scrape = 0.0
        try:
            a.start()  # its history, from its replay endpoint
            while not self._halt.is_set():
                a.poll(POLL_MS)
                if scraper is not None and time.monotonic() >= next_scrape:
                    next_scrape = time.monotonic() + 1.0
                    got = scraper.poll()
                    if scraper.error:
                        self._problem(f"{name}: metrics: {scraper.error}", key=f"metrics:{name}")
                    with self.lock:
                        self.points[rank] = scraper.last
                        if got:
                            self._deltas.append(got)
            a.poll(0)  # what arrived by the end
        except Exception as e:  # noqa: BLE001 - one instance's failure, said; the others go on
            a.health.bad_messages += 1
            a.health.note(f"its subscriber stopped: {type(e).__name__}: {e}")
            self._problem(f"{name}: the subscriber stopped: {type(e).__name__}: {e}")

    def close(self) -> None:
        self._halt.set()
        for t in self._drivers:
            t.join(timeout=5.0)
        super().close()

    # ------------------------------------------------------------------ a tick
    def tick(self, wall_s: float) -> None:
        with self.mirror_lock:
            self.slots.restarted = {r: n for r, n in enumerate(self._restarts())
                                    if n > self._restarts_seen[r]}
            self._restarts_seen = self._restarts()
            super().tick(wall_s)
            rows, ranks = self._rows(), self._slot_ranks()
        with self.lock:
            self.rows = rows
            self.slot_ranks[self.slots.step] = ranks
            for step in [s for s in self.slot_ranks if s < self.slots.step - HISTORY]:
                del self.slot_ranks[step]

    def _restarts(self) -> list[int]:
        return [self.mirror.health_of(r).restarts for r in range(len(self.names))]

    def _scrape(self, now: float) -> dict | None:
        """The instances' metrics deltas since the last tick, summed (KV usage: their mean)."""
        with self.lock:
            deltas, self._deltas = self._deltas, []
        if not deltas:
            return None
        out: dict[str, float] = {}
        for d in deltas:
            for key in ("hits", "queries", "preemptions"):
                if key in d:
                    out[key] = out.get(key, 0) + d[key]
        usage = [p.kv_usage for p in self.points if p is not None and p.kv_usage is not None]
        if usage:
            out["kv_usage"] = sum(usage) / len(usage)
        return out

    def _rows(self) -> list[InstanceRow]:
        resident = Counter(k[0] for k in self.mirror.blocks)
        rows = []
        for rank, inst in enumerate(self.instances):
            h, point = self.mirror.health_of(rank), self.points[rank]
            parity = self.mirror.parities.get(rank)
            differs = "" if parity is None or not parity.mismatched else \
                f"{parity.mismatched} of {parity.matched + parity.mismatched} blocks differ"
            rows.append(InstanceRow(
                inst.name, inst.endpoint, resident[rank], light(h), h.restarts, hit_rate(point),
                None if point is None else point.kv_usage, differs, h.lines()))
        return rows

    def _slot_ranks(self) -> dict[str, np.ndarray]:
        out = {}
        for tier, key_of in self.slots.key_of.items():
            ranks = np.full(self.slots.pools[tier].num_blocks, -1, np.int16)
            for slot, key in key_of.items():
                ranks[slot] = key[0]
            out[tier] = ranks
        return out

    def _check(self, now: float) -> None:
        for rank, (inst, a) in enumerate(zip(self.instances, self.attachments, strict=True)):
            h, name = self.mirror.health_of(rank), inst.name
            if not h.first_seq and now - self._t0 >= self.silent_s:
                self._problem(f"No KV events from {name} ({inst.endpoint}) after "
                              f"{self.silent_s:g} s ({a.num_messages} messages); the other "
                              "instances go on. Still listening.", key=f"silent:{name}")
            elif h.first_seq and self._said.get(f"silent:{name}"):
                with self.lock:
                    self._resolved.append(self._said[f"silent:{name}"])
                self._said[f"silent:{name}"] = ""
            if h.bad_messages:
                self._problem(f"{name} ({inst.endpoint}) sends messages that are not KV events: "
                              f"{h.notes[-1] if h.notes else ''}", key=f"bad:{name}")

    def _short_health(self) -> tuple[str, bool | None]:
        lights = [light(self.mirror.health_of(r)) for r in range(len(self.names))]
        if all(x is None for x in lights):
            return f"fleet of {len(lights)}: no events yet", None
        bad = [f"{n} ({self._trouble_words(r)})" for r, (n, x) in
               enumerate(zip(self.names, lights, strict=True)) if x is False]
        waiting = [n for n, x in zip(self.names, lights, strict=True) if x is None]
        text = f"fleet: {lights.count(True)} of {len(lights)} healthy" + \
            (f" · {', '.join(bad)}" if bad else "") + \
            (f" · waiting: {', '.join(waiting)}" if waiting else "") + \
            (f" · slot view full ({self.slots.num_overflow} pushed out)"
             if self.slots.num_overflow else "")
        return text, (not bad and not waiting and not self.slots.num_overflow)

    def _trouble_words(self, rank: int) -> str:
        h = self.mirror.health_of(rank)
        words = [f"{n} {w}" for n, w in ((h.restarts, "restarts"), (h.lost, "batches lost"),
                                          (h.orphans + h.orphan_removes, "orphans"),
                                          (h.bad_messages, "bad"), (len(h.unsure), "disconnected"))
                 if n]
        return ", ".join(words) or "history not seen from its start"

    def _health_lines(self) -> list[str]:
        lines = []
        for rank, inst in enumerate(self.instances):
            lines.append(f"instance {inst.name} ({inst.endpoint}):")
            lines += [f"  {x}" for x in self.mirror.health_of(rank).lines()]
            parity = self.mirror.parities.get(rank)
            if parity is not None and parity.mismatched:
                lines.append(f"  hashes differently: {parity.mismatched} blocks differ from "
                             "the hashes recomputed from their tokens")
        return lines

    def summary(self) -> str:
        m, lines = self.mirror, []
        for rank, inst in enumerate(self.instances):
            h = m.health_of(rank)
            lines.append(f"instance {inst.name} ({inst.endpoint}): resident "
                         f"{mirror_digest(m, rank)}; restarts {h.restarts}, gaps {h.gaps} "
                         f"(repaired {h.repaired}), orphans {h.orphans + h.orphan_removes}")
            lines += [f"  {x}" for x in h.lines()] + [f"  note: {n}" for n in h.notes]
            parity = m.parities.get(rank)
            if parity is not None:
                lines += [f"  {x}" for x in parity.lines()]
                if parity.mismatched:
                    lines.append(f"  instance {inst.name} hashes differently: "
                                 f"{parity.mismatched} blocks differ")
            scraper = self.scrapers[rank]
            if scraper is not None:
                lines.append("  metrics: " + (metrics_line(scraper.last) if scraper.last
                                              else scraper.error or "not scraped"))
        shared = Counter((g, md, hh) for _, g, md, hh in m.blocks)
        lines.append(f"fleet: {len(self.names)} instances, {m.num_resident} resident blocks, "
                     f"{sum(1 for n in shared.values() if n > 1)} block hashes held by more "
                     "than one instance")
        if self.record_path:
            lines.append(f"recorded: {self.record_path}" if self.recorder is not None else
                         f"not recorded: no KV events arrived ({self.record_path})")
        lines.append(f"blocks stored: {m.num_stored}, removed: {m.num_removed}, resident: "
                     f"{m.num_resident}, restarts: {sum(r.restarts for r in self._rows())}")
        return "\n".join(lines)

    def slot_tier(self, slot: int, tier: str = TOP) -> tuple | None:
        """The mirror key a slot of a tier holds now (None: empty)."""
        with self.mirror_lock:
            return self.slots.key_of.get(tier, {}).get(slot)
