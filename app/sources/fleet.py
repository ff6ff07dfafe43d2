"""An attached fleet (`kvscope attach --endpoint ... | --fleet FILE`) as a frame source: the
fleet's hash slots, or one instance's (`instance`: the others' slots shown empty), its rows, and
which instances hold a clicked block."""

from __future__ import annotations

import dataclasses

import numpy as np

from kvscope.app.frames import Frame
from kvscope.app.sources.attach import AttachSource
from kvscope.engine.snapshot import CACHED, FREE

CLEARED = {"ref_count": 0, "owner": -1, "block_hash": 0, "last_use": -1, "lru_rank": -1,
           "parent_hash": 0, "hit_count": 0, "cached_seq": 0}


def only_rank(snap, ranks: dict[str, np.ndarray], rank: int):
    """A hash-slot snapshot with only one rank's slots held (every tier): the others empty."""
    if snap is None:
        return None
    tiers = []
    for tier in snap.tiers():
        of = ranks.get(tier.medium or "GPU")
        if of is None or len(of) != tier.num_blocks:
            of = np.full(tier.num_blocks, -1)
        other = of != rank
        fields = {"state": np.where(other, FREE, tier.state).astype(tier.state.dtype)}
        for name, empty in CLEARED.items():
            arr = getattr(tier, name)
            if len(arr) == len(other):
                arr = arr.copy()
                arr[other] = empty
            fields[name] = arr
        state = fields["state"]
        free, cached = int((state == FREE).sum()), int((state == CACHED).sum())
        tiers.append(dataclasses.replace(
            tier, **fields, host=None, num_free_blocks=free, num_cached_blocks=cached,
            num_active_blocks=tier.num_blocks - free - cached,
            num_shared_blocks=int((fields["ref_count"] >= 2).sum()), block_tables={},
            more_tables=()))
    for upper, lower in zip(tiers, tiers[1:], strict=False):
        upper.host = lower
    return tiers[0]


class FleetView:
    """What a fleet's sources share: `instance` (a rank, None: all) picks whose slots the frames
    show, from each slot's rank at a step (`ranks_of`)."""

    names: list[str]
    instance: int | None = None

    def ranks_of(self, step: int) -> dict[str, np.ndarray]:
        """Tier -> each slot's rank (-1: none) at a step."""
        raise NotImplementedError

    def view(self, snap):
        """What the frames show of a fleet snapshot: one instance's slots, or all."""
        if self.instance is None or snap is None:
            return snap
        return only_rank(snap, self.ranks_of(snap.step), self.instance)

    def who(self) -> str:
        return "all instances" if self.instance is None else \
            f"instance {self.names[self.instance]}"


class FleetSource(FleetView, AttachSource):
    """Many servers' KV events at once (`FleetSession`)."""

    def __init__(self, fleet: list, topic: str = "", record: str | None = None, **options):
        """Raises ValueError with a one-line message for an address that cannot be used."""
        from kvscope.sessions.kv_events.fleet_session import FleetSession

        self._init(FleetSession(fleet, topic, record or None, **options), record)

    @property
    def names(self) -> list[str]:
        return self.session.names

    def rows(self) -> list:
        with self.session.lock:
            return list(self.session.rows)

    def ranks_of(self, step: int) -> dict[str, np.ndarray]:
        with self.session.lock:
            return self.session.slot_ranks.get(step, {})

    def take_frame(self) -> Frame | None:
        frame = super().take_frame()
        if frame is not None:
            frame.snapshot = self.view(frame.snapshot)
        return frame

    def newest(self) -> Frame:
        frame = super().newest()
        frame.snapshot = self.view(frame.snapshot)
        return frame

    everything = newest

    def frame_at(self, step: int) -> Frame:
        frame = super().frame_at(step)
        frame.snapshot = self.view(frame.snapshot)
        return frame

    def holders(self, slot: int, tier: str = "GPU") -> tuple[tuple, dict, list, dict] | None:
        """For the block hash in a slot: (its mirror key, instance -> tiers holding it, the
        chain from its first known block to it, instance -> leading blocks of that chain held);
        None for an empty slot."""
        s = self.session
        key = s.slot_tier(slot, tier)
        if key is None:
            return None
        with s.mirror_lock:
            chain = s.index.chain_to(key)
            return (key, s.index.holders(key[1], key[3]), chain,
                    s.index.prefix_held(chain, key[1], key[2]))

    def status_text(self, snap) -> str:
        return super().status_text(snap).replace(f" · {self.name} · ",
                                                 f" · {self.name} · {self.who()} · ", 1)
