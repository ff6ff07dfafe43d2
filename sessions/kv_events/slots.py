"""The mirror as a pool of hash slots: what the window shows and what a recording stores.

Physical block ids are not published, so each resident key of the mirror (data-parallel rank,
KV group, medium, hash) gets a slot of a `BlockPool` (the engine's own pool rules): one pool per
tier (vLLM's medium), each of as many slots; the GPU's is the snapshot, each tier below it
(CPU, STORAGE: by name) a snapshot hung under the one above (`Snapshot.host`, `Snapshot.tiers`)
with its medium and the forms of its stores. A key's short hash leaves the medium out, so one
(group, hash) has one short hash in every tier that holds it (its residency, read off a
snapshot). A tier's events name it (`Event.medium`); a recording takes a keyframe when a tier
or its forms change (`layout`). A stored
block is allocated, cached under a short hash of its key and released (state "cached"); a
removed one is uncached (state "free"). Every change is an engine event (ALLOCATED, CACHED,
FREED, UNCACHED, and EVICTED when more blocks are resident than there are slots) of the key's KV
group, one step per tick, so `Recorder` records the attached server like an engine and
`SessionReader` replays it: one schema. The snapshot carries the server's groups
(`Mirror.groups`) and each slot's group (`Snapshot.block_group`). A chain's first block hangs
under a root per identity (LoRA name, salt, rank, group, medium); a block whose parent was never
seen under a root of its own (an orphan). A fleet's (config.instances) store and remove events
are one instance's each and name it in their detail (instance_detail), a restart of one is a
zero-block UNCACHED event naming it, and an instance's short hashes are rank 0's xor its rank's
mask (rank_mask): a replay rebuilds whose each slot is and who holds a block
(app/sources/fleet_replay.py).

`HashSlots` quacks like the parts of `Engine` the recorder uses: config, num_blocks, loaded,
subscribe/unsubscribe, pool_state, unfinished_requests, request_output.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from kvscope.engine import events as ev
from kvscope.engine.block_pool import BlockPool
from kvscope.engine.metrics import StepRecord
from kvscope.engine.snapshot import FREE, CacheCounters, PoolState, Snapshot, tier_snapshot
from kvscope.engine.stream import StepUpdate
from kvscope.sessions.kv_events.mirror import PLACEHOLDER, Mirror

DEFAULT_SLOTS = 4096
ATTACH_PREFIX = "attached: "  # the recorded model name of an attached session starts with it
TOP = "GPU"  # the tier whose pool is the snapshot's own
_MEDIUM = re.compile(r"[A-Za-z0-9_.-]{1,24}")


@dataclass
class SlotConfig:
    """What a recording of an attached server stores as its engine config."""

    block_size: int
    num_blocks: int
    endpoint: str = ""
    replay: str | None = None
    topic: str = ""
    metrics: str | None = None
    record_events: bool = True
    enable_prefix_caching: bool = True
    eviction_policy: str = "lru"
    kv_cache_dtype: str | None = None
    device: str = "attached"
    instances: tuple = ()  # a fleet's instance names, by rank (kv_events.fleet)


def short_key(*parts) -> int:
    """A stable nonzero 64-bit key of a mirror key or a root (never Python's hash())."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def rank_mask(rank: int) -> int:
    """What a rank's short hashes are xor-ed with (0 for rank 0): an instance's short hash of a
    block is rank 0's xor its mask, so a replay tells which instances hold the same block."""
    return 0 if rank == 0 else short_key("rank", rank)


def slot_hashes(key: tuple, entry: list) -> tuple[int, int]:
    """(the slot's short hash, its parent's): the parent block's key in the same rank and group,
    or the root of the chain's identity (per medium) for a first block. The medium is left out
    of a hash: the same (group, hash) has the same short hash in every tier."""
    rank, group, medium, h = key
    parent, identity = entry[1], entry[3]
    mask = rank_mask(rank)
    up = short_key("root", rank, group, medium, *identity) if parent is None else \
        short_key(0, group, parent) ^ mask
    return short_key(0, group, h) ^ mask, up


def instance_detail(name: str, restart: int = 0) -> str:
    """A fleet's block event's detail: whose blocks they are (a replay reads it back:
    read_instance_detail); a restart of the instance (restart: its count) as one of its own."""
    text = f"instance {name}"
    return text + (f" · restart {restart}: its publisher started over, its blocks were dropped"
                   if restart else "")


_INSTANCE = re.compile(r"(?:^|.* · )instance ([A-Za-z0-9_.:-]{1,32})(?: · restart (\d+):.*)?")


def read_instance_detail(detail: str) -> tuple[str | None, int]:
    """(the instance a fleet's block event names, its restart count if it is a restart, else 0);
    (None, 0) for an event of a single server, or of a fleet recorded before instances were."""
    m = _INSTANCE.fullmatch(detail or "")
    return (None, 0) if m is None else (m.group(1), int(m.group(2) or 0))


def tier_name(medium: str) -> str:
    """A medium as a recording names its tier: as the server names it when that is a short
    plain word, else a digest of it (a stored event kind holds it)."""
    return medium if _MEDIUM.fullmatch(medium) else f"medium-{short_key(medium) & 0xffffff:06x}"


def forms_text(forms) -> str:
    """A tier's store forms in words ("placeholder stores (no tokens, block_size 0)")."""
    if not forms:
        return "no stores yet"
    text = " and ".join(sorted(forms)) + " stores"
    return text + " (no tokens, block_size 0)" if tuple(forms) == (PLACEHOLDER,) else text


def identity_label(identity: tuple) -> str:
    """(LoRA name, salt digest) in a few words; the salt only as its digest."""
    lora, salt = identity
    return (f"LoRA {lora}" if lora else "no LoRA") + (f" · salt #{salt[:8]}" if salt else
                                                       " · no salt")


def group_lines(snap: Snapshot) -> list[str]:
    """Each KV group of a hash-slot snapshot, one line: its index, kind (with its window) and
    resident blocks (slots holding a hash of the group)."""
    held = snap.block_group[snap.state != FREE] if len(snap.block_group) else []
    resident = np.bincount(np.asarray(held, np.int64), minlength=len(snap.groups))
    return [f"KV group {g}: {group.name} · {int(resident[g])} resident blocks"
            for g, group in enumerate(snap.groups)]


def tier_lines(snap: Snapshot) -> list[str]:
    """Each tier (vLLM's medium) of a hash-slot snapshot, one line: its resident blocks (slots
    holding a hash of the tier) and, for a tier below the GPU, the forms of its stores."""
    return [f"tier {t.medium or TOP}: {t.num_cached_blocks} resident blocks"
            + ("" if i == 0 else " · " + forms_text(t.forms))
            for i, t in enumerate(snap.tiers())]


def by_tier(keys: list[tuple]) -> dict[str, list[tuple]]:
    """Mirror keys by their tier's name (GPU first), in their order."""
    out: dict[str, list[tuple]] = {}
    for key in keys:
        out.setdefault(tier_name(key[2]), []).append(key)
    return dict(sorted(out.items(), key=lambda t: t[0] != TOP))


def _show(h) -> str:
    return (h.hex() if isinstance(h, bytes) else f"{h & (1 << 64) - 1:016x}")[:16] + "…"


def _bytes(short: int) -> bytes:
    return short.to_bytes(8, "little")


@dataclass
class SlotState:
    """`HashSlots.pool_state`: the GPU tier's PoolState and each tier below it as (name, forms,
    PoolCopy, evictions): cheap copies, made a Snapshot (`snapshot`) on another thread."""

    top: PoolState
    lower: list[tuple[str, tuple, object, int]]

    @property
    def groups(self):
        return self.top.groups

    def snapshot(self) -> Snapshot:
        snap = below = self.top.snapshot()
        snap.medium = TOP
        for tier, forms, pool, evicted in self.lower:
            below.host = below = tier_snapshot(pool, evicted, snap.step, snap.block_size,
                                               snap.groups, tier, forms)
        return snap


class HashSlots:
    def __init__(self, mirror: Mirror, num_slots: int = DEFAULT_SLOTS, block_size: int = 16,
                 name: str = "attached", **config):
        self.mirror = mirror
        if mirror.journal is None:
            mirror.journal = []
        self.pool = BlockPool(num_slots)  # the GPU tier's slots
        self.pools: dict[str, BlockPool] = {TOP: self.pool}  # tier name -> its slots
        self.config = SlotConfig(block_size, num_slots, **config)
        self.loaded = SimpleNamespace(name=ATTACH_PREFIX + name, fingerprint=None)
        self.cache_identity = ""
        self.device = "attached"
        self.slot_of: dict[tuple, int] = {}  # mirror key -> slot (in its tier's pool)
        self.key_of: dict[str, dict[int, tuple]] = {TOP: {}}  # tier -> slot -> mirror key
        self.step = -1
        self.num_overflow = 0  # resident blocks pushed out of the slot view (too few slots)
        self.hits = self.queries = 0  # cumulative, from the metrics endpoint
        self.sized = False  # block_size is the server's (seen in a store)
        self.restarted: dict[int, int] = {}  # a fleet's ranks restarted since the last tick
        self._subs: list = []

    # ------------------------------------------------------------- engine-like
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def subscribe(self, callback) -> None:
        self._subs.append(callback)

    def unsubscribe(self, callback) -> None:
        if callback in self._subs:
            self._subs.remove(callback)

    def unfinished_requests(self) -> list:
        return []

    def request_output(self, request_id: int):
        return None

    def counters(self) -> CacheCounters:
        return CacheCounters(hit_tokens=self.hits, query_tokens=self.queries,
                             num_evicted_blocks=self.mirror.num_removed)

    def pool_state(self) -> SlotState:
        step, size, groups = max(self.step, 0), self.config.block_size, self.mirror.groups()
        return SlotState(PoolState(step, size, self.pool.copy(), {}, {}, self.counters(), groups),
                         [(t, self.forms(t), p.copy(), p.num_evicted)
                          for t, p in sorted(self.pools.items()) if t != TOP])

    def lower(self) -> list[str]:
        """The tiers below the GPU that a store named so far, by name."""
        return sorted({tier_name(m) for _, m in self.mirror.forms} - {TOP})

    def forms(self, tier: str) -> tuple[str, ...]:
        """The forms of a tier's stores (every rank's), as the mirror saw them."""
        return tuple(sorted({f for (_, m), forms in self.mirror.forms.items()
                             if tier_name(m) == tier for f in forms}))

    def layout(self) -> tuple:
        """The tiers below the GPU and their forms: a recording keyframes where it changes."""
        return tuple((t, self.forms(t)) for t in self.lower())

    def snapshot(self) -> Snapshot:
        return self.pool_state().snapshot()

    # ------------------------------------------------------------- ticking
    def _uncache(self, tier: str, keys: list[tuple], step: int, now: int, events: list) -> None:
        pool, key_of, medium = self.pools[tier], self.key_of[tier], "" if tier == TOP else tier
        for (rank, group), group_keys in self._batches(keys).items():
            gone = []
            for key in group_keys:
                slot = self.slot_of.pop(key, None)
                if slot is not None:
                    del key_of[slot]
                    pool.uncache(slot)
                    gone.append(slot)
            if gone:
                events.append(ev.Event(ev.UNCACHED, step, None, tuple(gone), now,
                                       detail=self._whose("removed by the server", rank),
                                       group=group, medium=medium))

    def _store(self, tier: str, keys: list[tuple], adds: dict, step: int, now: int,
               events: list) -> None:
        if len(keys) > self.config.num_blocks:
            self.num_overflow += len(keys) - self.config.num_blocks
            keys = keys[-self.config.num_blocks:]
        pool, key_of, medium = self.pools[tier], self.key_of[tier], "" if tier == TOP else tier
        for (rank, group), group_keys in self._batches(keys).items():
            got, evicted = pool.allocate(len(group_keys), step, group)
            for slot in evicted:  # too few slots: the oldest resident blocks leave the view
                self.slot_of.pop(key_of.pop(slot), None)
            self.num_overflow += len(evicted)
            if evicted:
                events.append(ev.Event(ev.EVICTED, step, None, tuple(evicted), now,
                                       detail="more resident blocks than slots", group=group,
                                       medium=medium))
            events.append(ev.Event(ev.ALLOCATED, step, None, tuple(got), now, group=group,
                                   medium=medium))
            shorts, parents = [], []
            for slot, key in zip(got, group_keys, strict=True):
                h, p = slot_hashes(key, adds[key])
                pool.cache(slot, _bytes(h), _bytes(p))
                self.slot_of[key], key_of[slot] = slot, key
                shorts.append(h)
                parents.append(p)
            events.append(ev.Event(ev.CACHED, step, None, tuple(got), now,
                                   (*shorts, *parents), self._whose("", rank), group=group,
                                   medium=medium))
            tail_first = got[::-1]
            pool.release(tail_first, step)
            events.append(ev.Event(ev.FREED, step, None, tuple(tail_first), now, group=group,
                                   medium=medium))

    def _batches(self, keys: list[tuple]) -> dict[tuple, list[tuple]]:
        """Mirror keys by (rank, KV group) for a fleet (an event's blocks are one instance's),
        by (None, group) otherwise, in their order."""
        fleet, out = bool(self.config.instances), {}
        for key in keys:
            out.setdefault((key[0] if fleet else None, key[1]), []).append(key)
        return out

    def _whose(self, detail: str, rank: int | None) -> str:
        """An event's detail, naming the fleet's instance whose blocks it moves."""
        if rank is None:
            return detail
        name = instance_detail(self.config.instances[rank])
        return f"{detail} · {name}" if detail else name

    def describe(self, slot: int, tier: str = TOP) -> str | None:
        """What a slot of a tier holds, in one line (None: an empty slot)."""
        key = self.key_of.get(tier, {}).get(slot)
        entry = self.mirror.blocks.get(key) if key is not None else None
        if entry is None:
            return None
        rank, group, medium, h = key
        refs, parent, size, (lora, salt) = entry
        if parent is None:
            up = "first block of its chain"
        elif (rank, group, medium, parent) in self.mirror.blocks:
            up = f"parent {_show(parent)}"
        else:
            up = f"parent {_show(parent)} never seen (an orphan: history not seen or removed)"
        text = (f"{'' if tier == TOP else tier + ' '}hash slot {slot}: hash {_show(h)} · "
                f"{self.rank_label(rank)} · "
                f"{self.mirror.group_label(rank, group)} · {medium} · {size} tokens · {up}")
        if refs > 1:
            text += f" · {refs} copies (duplicate stores)"
        tiers = self.mirror.residency(group, h, rank)
        others = sorted(tiers - {medium}, key=lambda m: (m != TOP, m))
        text += (" · also in " + ", ".join(
            f"{m} (slot {self.slot_of[(rank, group, m, h)]})" if (rank, group, m, h)
            in self.slot_of else m for m in others)) if others else f" · only in {medium}"
        if lora or salt:
            text += f" · LoRA {lora or 'none'}, salt {f'#{salt[:8]}' if salt else 'none'}"
        return text

    def roots(self) -> dict[int, str]:
        """The identity root of each chain in the slot view: its short key (the parent hash of
        the chains' first blocks, one per identity, rank, group and medium) -> a label."""
        out: dict[int, str] = {}
        blocks = self.mirror.blocks
        for key in self.slot_of:
            entry = blocks.get(key)
            if entry is not None and entry[1] is None:
                rank, group, medium, _ = key
                root = short_key("root", rank, group, medium, *entry[3])
                if root not in out:
                    out[root] = identity_label(entry[3]) + \
                        (f" · {self.rank_label(rank)}, {self.mirror.group_label(rank, group)}, "
                         f"{medium}" if (rank, group, medium) != (0, 0, "GPU")
                         or self.config.instances else "")
        return out

    def rank_label(self, rank: int) -> str:
        """A rank in words: a fleet's instance by name, else a data-parallel rank."""
        names = self.config.instances
        return f"instance {names[rank]}" if rank < len(names) else f"dp rank {rank}"

    def learn_block_size(self, journal: list | None = None) -> bool:
        """Take the server's block size from its first store not yet applied here that names one
        (a placeholder store's is 0; before a recording starts: the file stores it). Returns
        whether it is known."""
        if not self.sized:
            journal = self.mirror.journal if journal is None else journal
            entry = next((item[2] for item in journal if item[0] == "+" and item[2][2]), None)
            if entry is not None:
                self.config.block_size, self.sized = entry[2], True
        return self.sized

    def tick(self, start_s: float, wall_s: float, metrics: dict | None = None) -> StepUpdate:
        """One step: what the mirror changed since the last tick, as pool events; metrics is
        a `metrics.delta` (query/hit tokens, preemptions) or None. Subscribers get the update."""
        step = self.step = self.step + 1
        journal, self.mirror.journal = self.mirror.journal, []
        # Removes of blocks stored before this tick go first, then the stores, then removes of
        # blocks stored within it: every store and remove becomes an event.
        adds: dict[tuple, list] = {}
        early: list[tuple] = []
        late: dict[tuple, None] = {}  # an ordered set: a busy tick has thousands
        for item in journal:
            if item[0] == "+":
                late.pop(item[1], None)  # stored, removed and stored again within the tick
                adds[item[1]] = item[2]
            elif item[1] in adds:
                late[item[1]] = None
            else:
                early.append(item[1])
        self.learn_block_size(journal)
        now = time.monotonic_ns()
        events: list[ev.Event] = []
        pool = self.pool
        for tier in self.lower():  # a tier's slots from its first store on
            if tier not in self.pools:
                self.pools[tier], self.key_of[tier] = BlockPool(pool.num_blocks), {}
        for rank, n in sorted(self.restarted.items()):  # a restart is recorded, blocks or none
            events.append(ev.Event(ev.UNCACHED, step, None, (), now,
                                   detail=instance_detail(self.config.instances[rank], n)))
        self.restarted = {}
        stores = list(adds)
        for phase in (early, stores, list(late)):
            for tier, keys in by_tier(phase).items():
                if phase is stores:
                    self._store(tier, keys, adds, step, now, events)
                else:
                    self._uncache(tier, keys, step, now, events)
        m = metrics or {}
        hits, queries = int(m.get("hits", 0)), int(m.get("queries", 0))
        self.hits += hits
        self.queries += queries
        free, active, cached = pool.counts()
        record = StepRecord(step, start_s, wall_s=wall_s, batch_size=0, num_free_blocks=free,
                            num_active_blocks=active, num_cached_blocks=cached, hit_tokens=hits,
                            query_tokens=queries, num_preempted=int(m.get("preemptions", 0)))
        update = StepUpdate(record, events, [], counters=self.counters())
        for callback in list(self._subs):
            callback(update)
        return update
