"""A recorded fleet (`kvscope attach --fleet ... --record`) replayed as live: the instance table
at each step (resident blocks, restarts and health lights as recorded), one instance's slots
(`instance`), and which instances hold a clicked block.

Each slot's instance is read off the recording's block events (their detail names it:
slots.instance_detail), folded step by step; a session recorded before they named it opens as a
plain replay (`open_replay`). Which instances hold a block: an instance's short hash is rank 0's
xor its rank's mask (slots.rank_mask), so the same block is found under every rank."""

from __future__ import annotations

import numpy as np

from kvscope.app.sources.fleet import FleetView
from kvscope.app.sources.replay import ReplaySource
from kvscope.engine import events as ev
from kvscope.engine.snapshot import FREE
from kvscope.sessions.kv_events.fleet_session import InstanceRow
from kvscope.sessions.kv_events.slots import TOP, rank_mask, read_instance_detail

CHECKPOINT = 64  # steps between the kept slot-rank arrays a seek starts from
RECORDED = ("as recorded: its stores, removals and restarts (gaps, orphans and metrics are "
            "not recorded)")


def open_replay(path: str) -> ReplaySource:
    """A session file as a source: a fleet's with its instances, when the file names them."""
    source = ReplaySource.open(path)
    names = list(source.reader.meta.engine_config.get("instances") or ())
    if not names:
        return source
    fleet = FleetReplaySource(source.reader, names)
    return fleet if fleet.recorded else source


class FleetReplaySource(FleetView, ReplaySource):
    def __init__(self, reader, names: list[str]):
        super().__init__(reader)
        self.names = names
        endpoints = str(reader.meta.engine_config.get("endpoint") or "").split()
        self.endpoints = endpoints if len(endpoints) == len(names) else [""] * len(names)
        rank = {name: r for r, name in enumerate(names)}
        self._changes: dict[int, list[tuple[str, list[int], int]]] = {}  # step -> stores
        self._restarts: list[list[tuple[int, int]]] = [[] for _ in names]  # (step, count)
        self._first: list[int | None] = [None] * len(names)  # each one's first store
        for step, e in reader.events_published(reader.first_step, reader.last_step):
            name, restart = read_instance_detail(e.detail)
            r = rank.get(name)
            if r is None:
                continue
            if restart:
                self._restarts[r].append((step, restart))
            elif e.kind == ev.CACHED:
                self._changes.setdefault(step, []).append((e.medium or TOP, list(e.blocks), r))
                if self._first[r] is None:
                    self._first[r] = step
        self.recorded = bool(self._changes)
        self._kept: dict[int, dict[str, np.ndarray]] = {}
        self._shown = None  # (the step shown, its snapshot of every instance, its slot ranks)
        self._rows: list[InstanceRow] = []

    # ------------------------------------------------------------- slot ranks
    def ranks_of(self, step: int) -> dict[str, np.ndarray]:
        """Tier -> each slot's rank at the end of a step (the last instance that stored into it;
        a slot empty at that step shows empty whatever it says)."""
        if self._shown is not None and self._shown[0] == step:
            return self._shown[2]
        base = max((k for k in self._kept if k <= step), default=None)
        ranks = {} if base is None else {t: a.copy() for t, a in self._kept[base].items()}
        n = self.reader.meta.num_blocks
        for s in range(self.reader.first_step if base is None else base + 1, step + 1):
            for tier, blocks, r in self._changes.get(s, ()):
                ranks.setdefault(tier, np.full(n, -1, np.int16))[blocks] = r
            if s % CHECKPOINT == 0:
                self._kept[s] = {t: a.copy() for t, a in ranks.items()}
        return ranks

    def frame_at(self, step: int):
        frame = super().frame_at(step)
        snap = frame.snapshot
        ranks = self.ranks_of(snap.step)
        self._shown = (snap.step, snap, ranks)
        self._rows = self._rows_at(snap, ranks)
        frame.snapshot = self.view(snap)
        return frame

    def _held(self, snap, ranks) -> dict[str, dict[tuple[int, int], int]]:
        """Tier -> (rank, short hash) -> slot, for the slots holding a hash."""
        out = {}
        for t in snap.tiers():
            tier = t.medium or TOP
            of = ranks.get(tier)
            if of is None:
                continue
            held = np.flatnonzero(t.state != FREE)
            out[tier] = {(int(of[i]), int(t.block_hash[i])): int(i) for i in held}
        return out

    # ------------------------------------------------------------- the table
    def rows(self) -> list[InstanceRow]:
        """The instances at the step shown."""
        return list(self._rows)

    def _rows_at(self, snap, ranks) -> list[InstanceRow]:
        resident = np.zeros(len(self.names), np.int64)
        for t in snap.tiers():
            of = ranks.get(t.medium or TOP)
            if of is not None:
                of = of[(t.state != FREE) & (of >= 0)]
                resident += np.bincount(of, minlength=len(self.names))[:len(self.names)]
        rows = []
        for r, name in enumerate(self.names):
            restarts = [(s, n) for s, n in self._restarts[r] if s <= snap.step]
            first = self._first[r]
            ok = False if restarts else (None if first is None or first > snap.step else True)
            rows.append(InstanceRow(
                name, self.endpoints[r], int(resident[r]), ok, restarts[-1][1] if restarts else 0,
                None, None, "", [RECORDED] + [f"restart {n} at step {s}" for s, n in restarts]))
        return rows

    def holders(self, slot: int, tier: str = TOP) -> tuple[tuple, dict, list, dict] | None:
        """As FleetSource.holders, at the step shown: (the slot's (rank, tier, short hash),
        instance -> tiers holding its block, its chain from the first block the step holds,
        instance -> leading blocks of that chain held in its tier); None for an empty slot."""
        if self._shown is None:
            return None
        _, snap, ranks = self._shown
        held = self._held(snap, ranks)
        mine = {s: key for key, s in held.get(tier, {}).items()}
        if slot not in mine:
            return None
        rank, short = mine[slot]
        block = short ^ rank_mask(rank)  # the block, whichever rank holds it
        holders: dict[str, set[str]] = {}
        for t, keys in held.items():
            for r, name in enumerate(self.names):
                if (r, block ^ rank_mask(r)) in keys:
                    holders.setdefault(name, set()).add(t)
        parents = {t.medium or TOP: t.parent_hash for t in snap.tiers()}[tier]
        chain, at = [], slot
        while at is not None and at not in chain:
            chain.append(at)
            at = held[tier].get((rank, int(parents[at])))
        chain = [mine[s][1] ^ rank_mask(rank) for s in reversed(chain)]
        prefix = {}
        for r, name in enumerate(self.names):
            n = 0
            while n < len(chain) and (r, chain[n] ^ rank_mask(r)) in held[tier]:
                n += 1
            prefix[name] = n
        return (rank, tier, short), holders, chain, prefix

    def describe_slot(self, slot: int, tier: str = TOP) -> str:
        found = None if self._shown is None else \
            {s: key for key, s in self._held(self._shown[1], self._shown[2]).get(tier, {})
             .items()}.get(slot)
        where = f"{'' if tier == TOP else tier + ' '}hash slot {slot}"
        if found is None:
            return f"{where}: empty at this step"
        rank, short = found
        return f"{where}: instance {self.names[rank]} · hash {short:016x}… (as recorded)"

    def status_text(self, snap) -> str:
        return (f"replay · {self.name} · {self.who()} · {snap.num_cached_blocks} resident "
                f"blocks in {snap.num_blocks} hash slots · step {snap.step}")
