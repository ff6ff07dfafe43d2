"""Eviction policies: which cached block (ref count 0, hash kept) a pool reuses next. One row
per policy in `POLICIES`; the engine's config, the CLI's choices, replay, the lab's runs, its
checkboxes and its plot all read the table, so a new policy is this file's one row (and its
ordered set, if the two below do not fit).

A policy's ordered set has push (a block became cached), remove (a hit took it back), pop (the
next to evict), clone, order (eviction order, a copy) and len. Every choice must be a
deterministic function of the calls (no randomness): replay depends on it. A timed policy (ttl)
reads a clock too, but only the one its caller sets (`BlockPool.expire(now)`: a trace's or a
session's timestamps), never the wall clock.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


class LruCached:
    """Cached blocks in release order: an OrderedDict is an O(1) linked set."""

    keeps_release_order = True  # a snapshot's queue order is this set's order, as it is

    def __init__(self):
        self._queue: OrderedDict[int, None] = OrderedDict()

    def push(self, block: int, pool) -> None:
        self._queue[block] = None

    def remove(self, block: int) -> None:
        del self._queue[block]

    def pop(self) -> int:
        return self._queue.popitem(last=False)[0]

    def clone(self) -> LruCached:
        new = LruCached()
        new._queue = self._queue.copy()
        return new

    def __len__(self) -> int:
        return len(self._queue)

    def order(self) -> list[int]:
        return list(self._queue)


class HeapCached:
    """Cached blocks in a heap on (policy key, release tick); removal is lazy: an entry counts
    only while it carries its block's current tick."""

    keeps_release_order = False

    def __init__(self, key):
        self._key = key  # (pool, block) -> the policy's sort key, read at release
        self._heap: list[tuple] = []
        self._tick: dict[int, int] = {}  # block -> tick of its live entry
        self._ticks = 0

    def push(self, block: int, pool) -> None:
        self._ticks += 1
        self._tick[block] = self._ticks
        heapq.heappush(self._heap, (self._key(pool, block), self._ticks, block))
        if len(self._heap) > 2 * len(self._tick) + 64:  # drop stale entries, keeps O(n) memory
            self._heap = [e for e in self._heap if self._tick.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def remove(self, block: int) -> None:
        del self._tick[block]

    def clone(self) -> HeapCached:
        new = HeapCached(self._key)
        new._heap, new._tick, new._ticks = self._heap[:], self._tick.copy(), self._ticks
        return new

    def pop(self) -> int:
        while True:
            _, tick, block = heapq.heappop(self._heap)
            if self._tick.get(block) == tick:
                del self._tick[block]
                return block

    def __len__(self) -> int:
        return len(self._tick)

    def order(self) -> list[int]:
        return [b for _, t, b in sorted(self._heap) if self._tick.get(b) == t]


class TtlCached(LruCached):
    """LRU order, each block with its release time on the pool's clock (`pool.clock`): the
    clock only moves forward, so the blocks that expired are a run at the head."""

    keeps_release_order = False  # a snapshot has no release times: rebuilt by push

    def push(self, block: int, pool) -> None:
        self._queue[block] = pool.clock

    def clone(self) -> TtlCached:
        new = TtlCached()
        new._queue = self._queue.copy()
        return new

    def expired(self, now: float, ttl_s: float) -> list[tuple[int, float]]:
        """(block, its release time) of each block released more than ttl_s before now,
        taken off the set, oldest first."""
        out, queue = [], self._queue
        while queue:
            block, released = next(iter(queue.items()))
            if now - released <= ttl_s:
                break
            queue.popitem(last=False)
            out.append((block, released))
        return out


@dataclass(frozen=True)
class Policy:
    name: str
    help: str  # one line: what goes first
    make: Callable[[], object]  # a new, empty ordered set of cached blocks
    timed: bool = False  # blocks also expire on a clock (needs a TTL and a caller's clock)


POLICIES: dict[str, Policy] = {p.name: p for p in (
    Policy("lru", "least recently released first (vLLM); a request releases its blocks tail "
           "first, so the end of a chain goes before its head", LruCached),
    Policy("fifo", "the block whose hash was registered earliest goes first",
           lambda: HeapCached(lambda pool, b: pool.cached_seq[b])),
    Policy("lfu", "fewest prefix hits since the block was cached, least recently released "
           "among equals", lambda: HeapCached(lambda pool, b: pool.hits[b])),
    Policy("ttl", "a cached block expires T seconds after its last use (the trace's clock), as "
           "an API's prompt cache; when the pool is full, least recently released first",
           TtlCached, timed=True),
)}


def names(timed: bool = True) -> tuple[str, ...]:
    """The policies, in table order (read when needed: a row added later shows); without the
    timed ones (which need a TTL and a clock) when `timed` is False."""
    return tuple(n for n, p in POLICIES.items() if timed or not p.timed)


def check(name) -> str | None:
    """None, or the one-line reason `name` is not a policy."""
    if name in POLICIES:
        return None
    return f"eviction policy must be one of {', '.join(POLICIES)}, got {name!r}"


def cached_set(name: str):
    problem = check(name)
    if problem:
        raise ValueError(problem)
    return POLICIES[name].make()
