"""Events: small records of everything the cache manager and scheduler do. Torch-free."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

# Block events (the cache manager).
ALLOCATED = "allocated"  # fresh blocks taken from the pool for a request
CACHE_HIT = "cache_hit"  # cached blocks reused by a request at admission
CACHED = "cached"  # full blocks whose hash was registered: reusable from now on
#                    (hashes: the blocks' short hashes, then their chain parents' short hashes)
EVICTED = "evicted"  # cached blocks whose hash was dropped to reuse the block
FREED = "freed"  # a request released its blocks (tail first)
COW = "cow"  # copy-on-write: blocks = (source, copy)
FORKED = "forked"  # a request was forked: blocks = the blocks now shared with the parent
RESET = "reset"  # reset_prefix_cache(): blocks = the blocks whose hash was dropped
UNCACHED = "uncached"  # hashes withdrawn: the forward pass that was to write their KV failed

BLOCK_EVENTS = (ALLOCATED, CACHE_HIT, CACHED, EVICTED, FREED, COW, FORKED, RESET, UNCACHED)

# Request events (the scheduler and the engine).
ARRIVED = "arrived"  # add_request accepted it into the waiting queue
ADMITTED = "admitted"  # moved from waiting to running (detail: cached / to compute)
PREFILL = "prefill"  # a prompt chunk computed (detail: tokens)
DECODE = "decode"  # one decode token computed
PREEMPTED = "preempted"  # gave its blocks back, to be recomputed later
CANCELLED = "cancelled"
REJECTED = "rejected"  # can never fit the pool (detail: why)
FINISHED = "finished"  # detail: the finish reason

REQUEST_EVENTS = (ARRIVED, ADMITTED, PREFILL, DECODE, PREEMPTED, CANCELLED, REJECTED, FINISHED)


@dataclass(frozen=True, slots=True)
class Event:
    kind: str
    step: int
    request_id: int | None
    blocks: tuple[int, ...] = ()
    time_ns: int = 0  # time.monotonic_ns() when it happened
    hashes: tuple[int, ...] = ()  # short block hashes, for CACHED events
    detail: str = ""


class EventLog:
    """An append-only buffer that the producer never waits on; consumers drain it. Bounded: when
    nobody drains it, the oldest events go (counted in `num_dropped`) rather than memory."""

    def __init__(self, enabled: bool = True, capacity: int = 1 << 16):
        self.enabled = enabled
        self._events: deque[Event] = deque(maxlen=capacity)
        self.num_dropped = 0

    def emit(self, kind, step, request_id, blocks=(), hashes=(), detail="") -> None:
        if self.enabled:
            if len(self._events) == self._events.maxlen:
                self.num_dropped += 1
            self._events.append(
                Event(kind, step, request_id, tuple(blocks), time.monotonic_ns(), tuple(hashes),
                      detail)
            )

    def drain(self) -> list[Event]:
        events = list(self._events)
        self._events.clear()
        return events

    def __len__(self) -> int:
        return len(self._events)
