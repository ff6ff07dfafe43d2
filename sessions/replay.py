"""Rebuild the block pool between keyframes by replaying the recorded block events. Torch-free.

`PoolReplay` mirrors `BlockPool` + the per-request block tables of `KVCacheManager`, driven only
by events: every pool mutation emits one (allocate -> ALLOCATED after EVICTED, take -> CACHE_HIT
or FORKED, release -> FREED or the source of a COW, cache -> CACHED, reset -> RESET), and the
event says which blocks, in which order, at which step. From them the mirror keeps ref counts,
short hashes, last-use steps, the free queue in LRU order (head pops, tail appends, unhashed
releases to the head, hits removed from the middle) and the block tables. What events do not
carry (the computed-token counts and the manager's running totals) is recorded per step and set
with `end_step`. Any disagreement with the pool's own rules raises `ReplayError` rather than
returning a wrong snapshot.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import accumulate

import numpy as np

from kvscope.engine import events as ev
from kvscope.engine.snapshot import ACTIVE, CACHED, FREE, SHARED, Snapshot
from kvscope.sessions.errors import ReplayError
from kvscope.sessions.schema import event_columns

_BLOCK_EVENTS = frozenset(ev.BLOCK_EVENTS)


class PoolReplay:
    def __init__(self, keyframe: Snapshot):
        s = keyframe
        self.block_size = s.block_size
        self.num_blocks = s.num_blocks
        self.step = s.step
        self.ref = s.ref_count.tolist()
        hashed = (s.state == CACHED) | (s.block_hash != 0)
        self.hash = np.where(hashed, s.block_hash, 0).tolist()
        self.last_use = s.last_use.tolist()
        self.parent = np.where(hashed, s.parent_hash, 0).tolist()
        self.hits = s.hit_count.tolist()
        queued = np.flatnonzero(s.lru_rank >= 0)
        order = queued[np.argsort(s.lru_rank[queued], kind="stable")]
        self.queue: OrderedDict[int, None] = OrderedDict.fromkeys(order.tolist())
        self.tables: dict[int, list[int]] = {r: t.tolist() for r, t in s.block_tables.items()}
        self.nct = dict(s.num_computed_tokens)
        self.totals = {k: getattr(s, k) for k in ("hit_tokens", "query_tokens",
                                                  "num_requests_queried", "num_requests_hit",
                                                  "num_evicted_blocks", "num_cow_copies")}

    # ------------------------------------------------------------- pool rules
    def _take(self, blocks, step: int) -> None:
        ref, queue, last = self.ref, self.queue, self.last_use
        for b in blocks:
            if ref[b] == 0:
                try:
                    del queue[b]
                except KeyError:
                    raise ReplayError(f"step {step}: block {b} taken but not in the free queue") \
                        from None
            ref[b] += 1
            last[b] = step

    def _release(self, blocks, step: int) -> None:
        ref, queue, last, hashes = self.ref, self.queue, self.last_use, self.hash
        for b in blocks:
            if ref[b] <= 0:
                raise ReplayError(f"step {step}: block {b} released with ref count {ref[b]}")
            ref[b] -= 1
            last[b] = step
            if ref[b] == 0:
                queue[b] = None
                if not hashes[b]:
                    queue.move_to_end(b, last=False)

    def apply_packed(self, row) -> None:
        """Apply the block events of one packed `events` row (see schema.pack_events)."""
        kinds = row[2].split("\n")
        idx = [i for i, k in enumerate(kinds) if k in _BLOCK_EVENTS]
        if not idx:
            return
        kinds, steps, rids, _, nb, blocks, nh, hashes, _ = event_columns(row, with_details=False)
        b_end, h_end = list(accumulate(nb)), list(accumulate(nh))
        apply = self.apply
        for i in idx:
            be, he = b_end[i], h_end[i]
            rid = rids[i]
            apply(kinds[i], steps[i], None if rid < 0 else rid, blocks[be - nb[i]:be],
                  hashes[he - nh[i]:he])

    def apply_event(self, e: ev.Event) -> None:
        self.apply(e.kind, e.step, e.request_id, e.blocks, e.hashes)

    def apply(self, kind: str, st: int, rid: int | None, blocks: tuple[int, ...],
              hashes: tuple[int, ...] = ()) -> None:
        """Apply one event (request events change nothing in the pool)."""
        if kind == ev.ALLOCATED:
            queue, ref, last = self.queue, self.ref, self.last_use
            for b in blocks:
                head = next(iter(queue), None)
                if head != b:
                    raise ReplayError(f"step {st}: block {b} allocated, but the head of the free "
                                      f"queue is {head}")
                queue.popitem(last=False)
                ref[b] = 1
                last[b] = st
            self.tables.setdefault(rid, []).extend(blocks)
        elif kind == ev.EVICTED:
            self._drop(blocks)
        elif kind == ev.CACHED:  # hashes: the blocks' hashes, then their chain parents'
            n = len(blocks)
            if len(hashes) != 2 * n:
                raise ReplayError(f"step {st}: cached event with {len(hashes)} hashes for {n} "
                                  "blocks")
            for b, h, p in zip(blocks, hashes[:n], hashes[n:], strict=True):
                self.hash[b], self.parent[b] = h, p
        elif kind in (ev.CACHE_HIT, ev.FORKED):  # a prefix hit, or a child sharing its parent's
            self._take(blocks, st)
            self.tables[rid] = list(blocks)
            if kind == ev.CACHE_HIT:
                for b in blocks:
                    self.hits[b] += 1
        elif kind == ev.FREED:
            self._release(blocks, st)
            self.tables.pop(rid, None)
        elif kind == ev.COW:
            src, dst = blocks
            self._release((src,), st)
            table = self.tables.get(rid)
            if not table or table[-1] != dst or src not in table:
                raise ReplayError(f"step {st}: copy-on-write {src}->{dst} of request {rid} does "
                                  "not match its block table")
            table.pop()  # the copy was allocated (ALLOCATED) just before, not appended
            table[table.index(src)] = dst
        elif kind == ev.UNCACHED:  # a failed step's hashes withdrawn (not an eviction)
            self._drop(blocks)
            for b in blocks:
                if self.ref[b] == 0:
                    self.queue.move_to_end(b, last=False)
        elif kind == ev.RESET:
            self._drop(blocks)
            for b in reversed(blocks):
                if self.ref[b] == 0:
                    self.queue.move_to_end(b, last=False)

    def _drop(self, blocks) -> None:
        """Hashes dropped (evicted or reset): the parent link and the hit count go with them."""
        for b in blocks:
            self.hash[b] = self.parent[b] = self.hits[b] = 0

    def end_step(self, step: int, nct: dict[int, int], totals: dict[str, int]) -> None:
        """Close a step: the live requests are those with computed-token counts."""
        self.step = step
        self.nct = nct
        self.totals = totals
        tables = self.tables
        if tables.keys() != nct.keys():
            for r in [r for r in tables if r not in nct]:
                if tables[r]:
                    raise ReplayError(f"step {step}: request {r} holds blocks {tables[r]} but "
                                      "is not live")
                del tables[r]
            for r in nct:
                tables.setdefault(r, [])

    # ---------------------------------------------------------------- output
    def snapshot(self) -> Snapshot:
        return build_snapshot(self.step, self.block_size, np.array(self.ref, dtype=np.int32),
                              np.array(self.hash, dtype=np.uint64),
                              np.array(self.last_use, dtype=np.int64), self.queue, self.tables,
                              self.nct, self.totals, np.array(self.parent, dtype=np.uint64),
                              np.array(self.hits, dtype=np.int32))


def build_snapshot(step: int, block_size: int, ref: np.ndarray, block_hash: np.ndarray,
                   last_use: np.ndarray, queue, tables: dict[int, list[int]],
                   nct: dict[int, int], totals: dict[str, int], parent_hash: np.ndarray,
                   hit_count: np.ndarray) -> Snapshot:
    """A Snapshot from pool state, computed exactly as KVCacheManager.snapshot does: `queue` is
    the free queue in LRU order (head first), `block_hash` the short hashes (0: none)."""
    n = len(ref)
    hashed = block_hash != 0
    state = np.full(n, FREE, dtype=np.uint8)
    state[hashed] = CACHED
    state[ref >= 1] = ACTIVE
    state[ref >= 2] = SHARED
    lru_rank = np.full(n, -1, dtype=np.int32)
    lru_rank[np.fromiter(queue, dtype=np.int64, count=len(queue))] = \
        np.arange(len(queue), dtype=np.int32)
    owner = np.full(n, -1, dtype=np.int64)
    for rid in sorted(tables, reverse=True):  # the lowest id ends up as the owner
        owner[tables[rid]] = rid
    num_active = int((ref >= 1).sum())
    num_cached = int((hashed & (ref == 0)).sum())
    return Snapshot(
        step=step, block_size=block_size, state=state, ref_count=ref, owner=owner,
        block_hash=block_hash, last_use=last_use, lru_rank=lru_rank, parent_hash=parent_hash,
        hit_count=hit_count,
        block_tables={r: np.array(t, dtype=np.int32) for r, t in tables.items()},
        num_computed_tokens=dict(nct),
        num_free_blocks=n - num_active - num_cached, num_active_blocks=num_active,
        num_cached_blocks=num_cached, num_shared_blocks=int((ref >= 2).sum()),
        **totals,
    )
