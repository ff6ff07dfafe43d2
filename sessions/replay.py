"""Rebuild the block pool between keyframes by replaying the recorded block events. Torch-free.

There is one pool state machine: `PoolReplay` drives the engine's own `BlockPool` from the
events, so the rules (which block is reused next, unhashed blocks first, eviction, reset) are
the engine's, under the recorded eviction policy. Every pool mutation emits one event
(allocate -> EVICTED then ALLOCATED, take -> CACHE_HIT or FORKED, release -> FREED or the
source of a COW, cache -> CACHED, reset -> RESET, uncache -> UNCACHED), and each is checked
against the pool's own choice: an allocation must hand out the recorded blocks, evicting the
recorded ones. Block tables are rebuilt from the same events. What events do not carry (the
computed-token counts and the running totals) is recorded per step and set with `end_step`.
Any disagreement raises `ReplayError` rather than returning a wrong snapshot. Hashes are the
recorded short hashes (8 bytes): the pool treats them as opaque keys; in KV-cache group g > 0
(a block event's kind "<kind>@g") the pool's keys are kv_groups.group_key of them, and each
group has its own block tables (NULL where a sliding window released a block). A host tier
(engine.host_tier) is a second BlockPool under its own policy, driven by its events the same way
(HOST_EVICTED then OFFLOADED: allocate, cache, release; LOADED: hold until the next step, and
cache the device blocks), its keys per group as the device's. An attached server's tiers below
its GPU (a keyframe's tiers with a medium) are hash-slot pools of their own, driven by block
events that name them ("<kind>#CPU").
"""

from __future__ import annotations

import sys

from kvscope.engine import events as ev
from kvscope.engine.block_pool import BlockPool, NoFreeBlocksError
from kvscope.engine.kv_groups import NULL, group_key
from kvscope.engine.snapshot import CacheCounters, Snapshot, tier_snapshot
from kvscope.sessions.errors import ReplayError
from kvscope.sessions.schema import event_columns, split_kind, split_tier

_BLOCK_EVENTS = frozenset((*ev.BLOCK_EVENTS, *ev.HOST_EVENTS))
# The packed hashes column holds uint64s in the machine's order: on a little-endian machine its
# 8-byte slices are the pool's keys as they are (no int -> bytes per hash).
_RAW_KEYS = sys.byteorder == "little"


def _key(short: int) -> bytes:
    return int(short).to_bytes(8, "little")


class PoolReplay:
    def __init__(self, keyframe: Snapshot, eviction_policy: str = "lru",
                 host_eviction_policy: str = "lru"):
        s = keyframe
        self.block_size, self.medium = s.block_size, s.medium
        self.step = s.step
        self.pool = BlockPool.from_snapshot(s, eviction_policy)
        # each tier below: (its keyframe, its pool); an attached server's by their medium
        self.lower = [(t, BlockPool.from_snapshot(t, host_eviction_policy)) for t in s.tiers()[1:]]
        self.host = self.lower[0][1] if self.lower else None
        self.tier_pools = {t.medium: p for t, p in self.lower if t.medium}
        # host blocks held for a load, released when the next step begins (as HostTier does)
        self._held: list[int] = [] if s.host is None else \
            [b for b, n in enumerate(s.host.ref_count.tolist()) for _ in range(n)]
        self._held_step = s.step
        self._host_evicted: list[int] = []
        self.tables: dict[int, list[int]] = {r: t.tolist() for r, t in s.block_tables.items()}
        self.groups = s.groups
        self.more = [{r: t.tolist() for r, t in g.items()} for g in s.more_tables]
        self.more += [{} for _ in range(len(s.groups) - 1 - len(self.more))]
        self.nct = dict(s.num_computed_tokens)
        self.counters = s.counters
        self._evicted: list[int] = []  # an EVICTED event's blocks, checked by the ALLOCATED next
        self._has_seq = len(s.cached_seq) > 0  # sessions recorded before it have no cached_seq

    def copy(self) -> PoolReplay:
        """An independent replay in the same state (to replay on while this one is kept)."""
        new = object.__new__(PoolReplay)
        new.__dict__.update(self.__dict__)
        new.pool = self.pool.clone()
        new.lower = [(t, p.clone()) for t, p in self.lower]
        new.host = new.lower[0][1] if new.lower else None
        new.tier_pools = {t.medium: p for t, p in new.lower if t.medium}
        new._held, new._host_evicted = self._held[:], self._host_evicted[:]
        new.tables = {r: t[:] for r, t in self.tables.items()}
        new.more = [{r: t[:] for r, t in g.items()} for g in self.more]
        new.nct, new._evicted = dict(self.nct), self._evicted[:]
        return new

    def apply_packed(self, row) -> None:
        """Apply the block events of one packed `events` row (see schema.pack_events): as
        `apply` for each, with less work per event (seeking replays thousands of them)."""
        if _BLOCK_EVENTS.isdisjoint(split_kind(k)[0] for k in row[2].split("\n")):
            return
        kinds, steps, rids, _, nb, blocks, nh, hashes, _ = event_columns(row, with_details=False)
        raw = (row[9] or None) if _RAW_KEYS else None
        apply, cached = self._apply, ev.CACHED
        b = h = 0
        kind, st, these = "", 0, []
        try:
            for i, kind in enumerate(kinds):
                n, m = nb[i], nh[i]
                kind, medium = split_tier(kind) if "#" in kind else (kind, "")
                kind, group = split_kind(kind) if "@" in kind else (kind, 0)
                if kind in _BLOCK_EVENTS:
                    st, these = steps[i], blocks[b : b + n].tolist()
                    if kind == cached and raw is not None and m == 2 * n and not group \
                            and not medium:
                        self._cache(these, [raw[8 * j : 8 * j + 8] for j in range(h, h + m)], st)
                    else:
                        rid = rids[i]
                        apply(kind, st, None if rid < 0 else rid, these, hashes[h : h + m],
                              group, medium)
                b += n
                h += m
        except (NoFreeBlocksError, KeyError, IndexError, ValueError) as e:
            raise ReplayError(f"step {st}: {kind} {these} does not replay: {e}") from None

    def apply_event(self, e: ev.Event) -> None:
        self.apply(e.kind, e.step, e.request_id, e.blocks, e.hashes, e.group, e.medium)

    def apply(self, kind: str, st: int, rid: int | None, blocks, hashes=(), group=0,
              medium: str = "") -> None:
        """Apply one event (request events change nothing in the pool)."""
        try:
            self._apply(kind, st, rid, list(blocks), hashes, group, medium)
        except (NoFreeBlocksError, KeyError, IndexError, ValueError) as e:
            raise ReplayError(f"step {st}: {kind} {blocks} does not replay: {e}") from None

    def _apply(self, kind: str, st: int, rid: int | None, blocks: list[int], hashes,
               group: int = 0, medium: str = "") -> None:
        """medium: an attached server's tier below its GPU, whose pool the event is of."""
        pool = self.tier_pools[medium] if medium else self.pool
        if self._held and st > self._held_step:
            self._release_held(st)
        tables = self.more[group - 1] if group else self.tables
        if kind == ev.EVICTED:
            self._evicted = blocks
        elif kind == ev.ALLOCATED:
            got, evicted = pool.allocate(len(blocks), st, group)
            if got != blocks or evicted != self._evicted:
                raise ReplayError(f"step {st}: blocks {blocks} allocated evicting "
                                  f"{self._evicted}, but the pool hands out {got} evicting "
                                  f"{evicted}")
            self._evicted = []
            tables.setdefault(rid, []).extend(blocks)
        elif kind == ev.CACHED:  # hashes: the blocks' hashes, then their chain parents'
            if len(hashes) != 2 * len(blocks):
                raise ReplayError(f"step {st}: cached event with {len(hashes)} hashes for "
                                  f"{len(blocks)} blocks")
            self._cache(blocks, [group_key(_key(h), group) for h in hashes], st, pool)
        elif kind in (ev.CACHE_HIT, ev.FORKED):  # a prefix hit, or a child sharing its parent's
            pool.take([b for b in blocks if b != NULL], st, hit=kind == ev.CACHE_HIT)
            tables[rid] = blocks
        elif kind == ev.FREED:
            self._release(blocks, st, pool)
            tables.pop(rid, None)
        elif kind == ev.OUT_OF_WINDOW:  # the table's first blocks, tail first
            self._release(blocks, st)
            table = tables[rid]
            for b in blocks:
                table[table.index(b)] = NULL
        elif kind == ev.COW:
            src, dst = blocks
            self._release([src], st)
            table = tables.get(rid)
            if not table or table[-1] != dst or src not in table:
                raise ReplayError(f"step {st}: copy-on-write {src}->{dst} of request {rid} does "
                                  "not match its block table")
            table.pop()  # the copy was allocated (ALLOCATED) just before, not appended
            table[table.index(src)] = dst
        elif kind == ev.RESET:
            dropped = pool.reset(st)
            if sorted(dropped) != sorted(blocks):
                raise ReplayError(f"step {st}: a reset dropped {blocks}, the pool {dropped}")
        elif kind == ev.UNCACHED:
            for b in blocks:
                pool.uncache(b)
        elif kind in ev.HOST_EVENTS:
            self._apply_host(kind, st, blocks, hashes, group)

    def _apply_host(self, kind: str, st: int, blocks: list[int], hashes, group: int) -> None:
        host, n = self.host, len(blocks) // 2
        if host is None:
            raise ReplayError(f"step {st}: a {kind} event, but the session has no host tier")
        keys = [group_key(_key(h), group) for h in hashes]
        if kind == ev.HOST_EVICTED:
            self._host_evicted = blocks
        elif kind == ev.OFFLOADED:  # device blocks -> host blocks, as HostTier.offload_evicted
            got, evicted = host.allocate(n, st, group)
            if got != blocks[n:] or evicted != self._host_evicted:
                raise ReplayError(f"step {st}: host blocks {blocks[n:]} taken evicting "
                                  f"{self._host_evicted}, but the host tier hands out {got} "
                                  f"evicting {evicted}")
            self._host_evicted = []
            for b, h, p in zip(got, keys[:n], keys[n:], strict=True):
                host.cache(b, h, p)
            host.release(got, st)
        elif kind == ev.LOADED:  # host blocks -> fresh device blocks, cached there
            host.take(blocks[:n], st, hit=True)
            self._held += blocks[:n]
            self._held_step = st
            self._cache(blocks[n:], keys, st)

    def _release_held(self, st: int) -> None:
        """The host blocks held for the last step's loads go back (HostTier.begin_step)."""
        self.host.release(sorted(self._held), st)
        self._held = []

    def _cache(self, blocks: list[int], keys: list[bytes], st: int, pool=None) -> None:
        """keys: the blocks' hashes, then their chain parents' (as the pool's keys)."""
        n, cache = len(blocks), (pool or self.pool).cache
        for b, h, p in zip(blocks, keys[:n], keys[n:], strict=True):
            if not cache(b, h, p):
                raise ReplayError(f"step {st}: block {b} cached under a hash another block "
                                  "holds")

    def _release(self, blocks: list[int], st: int, pool=None) -> None:
        pool = pool or self.pool
        for b in blocks:
            if pool.ref_count[b] <= 0:
                raise ReplayError(f"step {st}: block {b} released with ref count "
                                  f"{pool.ref_count[b]}")
        pool.release(blocks, st)

    def end_step(self, step: int, nct: dict[int, int], totals: dict[str, int]) -> None:
        """Close a step: the live requests are those with computed-token counts."""
        if self._held and step > self._held_step:
            self._release_held(step)
        self.step = step
        self.nct = nct
        self.counters = CacheCounters(**totals)
        for tables in (self.tables, *self.more):
            if tables.keys() != nct.keys():
                for r in [r for r in tables if r not in nct]:
                    if any(b != NULL for b in tables[r]):
                        raise ReplayError(f"step {step}: request {r} holds blocks {tables[r]} "
                                          "but is not live")
                    del tables[r]
                for r in nct:
                    tables.setdefault(r, [])

    def snapshot(self) -> Snapshot:
        snap = below = Snapshot.from_pool(self.pool, self.tables, self.nct, self.counters,
                                          self.step, self.block_size, self.groups, self.more)
        snap.medium = self.medium
        for t, pool in self.lower:
            below.host = below = tier_snapshot(pool, pool.num_evicted, self.step,
                                               self.block_size, t.groups, t.medium, t.forms)
        if not self._has_seq:  # as the session's own keyframes: without it
            snap.cached_seq = snap.cached_seq[:0]
        return snap
