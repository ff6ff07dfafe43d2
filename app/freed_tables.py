"""The block tables requests freed, and which of those blocks the pool still holds: learnt from the
events (every one reaches the window, unlike snapshots), so a finished request's blocks can be
looked up again by hash, listed (the requests panel) and outlined (the pool, the tree). Qt-free.

The events are only kept as they come (`follow` is O(1) a frame: a lab replay's first frame holds
a million block ids); they are read the first time a freed table is asked for."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from kvscope.engine import events as ev
from kvscope.engine.snapshot import CACHED, Snapshot

KEEP_TABLES = 2048  # the tables of the requests that freed blocks last
MAX_UNREAD = 200_000  # events kept unread at most: past that they are read as they come
_DROPPED = (ev.EVICTED, ev.RESET, ev.UNCACHED)


@dataclass(frozen=True)
class FreedTable:
    """A request's blocks when it freed them (table order, group after group: a sliding-window
    group's nulls are not among them), each one's hash then (0: its last, partial block: never
    cached), and each one's KV-cache group."""

    step: int
    blocks: np.ndarray
    hashes: np.ndarray
    group: np.ndarray  # int64 per block

    def joined(self, other: FreedTable) -> FreedTable:
        return FreedTable(self.step, *(np.concatenate([getattr(self, f), getattr(other, f)])
                                       for f in ("blocks", "hashes", "group")))

    def kept(self, snap: Snapshot) -> np.ndarray:
        """Per block, whether the pool still holds its KV (the same hash: cached, or in use by
        other requests)."""
        return (self.hashes != 0) & (snap.block_hash[self.blocks] == self.hashes)

    def counts(self, snap: Snapshot) -> dict[str, np.ndarray]:
        """Per block: kept, cached (kept, no owner), in_use (kept, by others), gone (evicted or
        reset since), partial."""
        kept = self.kept(snap)
        cached = kept & (snap.state[self.blocks] == CACHED)
        partial = self.hashes == 0
        return {"kept": kept, "cached": cached, "in_use": kept & ~cached,
                "gone": ~kept & ~partial, "partial": partial}


class FreedTables:
    def __init__(self):
        self.clear()

    def clear(self) -> None:
        """A new source: nothing known."""
        self._tables: dict[int, FreedTable] = {}
        self._hashes: dict[int, int] = {}  # block -> its hash, as the events read so far say
        self._unread: list[list[ev.Event]] = []
        self._num_unread = 0

    def follow(self, events: list[ev.Event]) -> None:
        """The events of a frame, in order."""
        if events:
            self._unread.append(events)
            self._num_unread += len(events)
            if self._num_unread > MAX_UNREAD:
                self._read()

    def get(self, request_id: int | None, snap: Snapshot | None = None) -> FreedTable | None:
        """The blocks the request freed last, by the step of `snap` (None: none)."""
        if request_id is None:
            return None
        self._read()
        table = self._tables.get(request_id)
        if table is None or (snap is not None and table.step > snap.step):
            return None
        return table

    def still_held(self, request_id: int | None, snap: Snapshot) -> np.ndarray:
        """The blocks the request freed that the pool still holds in `snap` (none: empty)."""
        table = self.get(request_id, snap)
        if table is None:
            return np.zeros(0, dtype=np.int64)
        return table.blocks[table.kept(snap)]

    def _read(self) -> None:
        if not self._unread:
            return
        hashes, tables = self._hashes, self._tables
        for e in itertools.chain.from_iterable(self._unread):
            kind = e.kind
            if kind == ev.CACHED:
                # its blocks' hashes; their parents' come after, unused
                hashes.update(zip(e.blocks, e.hashes, strict=False))
            elif kind == ev.FREED:
                if e.request_id is not None:
                    table = e.blocks[::-1]  # freed tail first
                    freed = FreedTable(
                        e.step, np.asarray(table, dtype=np.int64),
                        np.fromiter((hashes.get(b, 0) for b in table), dtype=np.uint64,
                                    count=len(table)), np.full(len(table), e.group))
                    last = tables.pop(e.request_id, None)
                    if (last is not None and last.step == e.step
                            and e.group > last.group.max(initial=-1)):
                        freed = last.joined(freed)  # the same release, its next group
                    tables[e.request_id] = freed
            elif kind in _DROPPED:
                for b in e.blocks:
                    hashes.pop(b, None)
        self._unread, self._num_unread = [], 0
        while len(tables) > KEEP_TABLES:
            del tables[next(iter(tables))]
