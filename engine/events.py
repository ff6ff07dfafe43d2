"""Events: small typed records of everything the cache manager and scheduler do. Torch-free.

One `Event` type, one `EventKind` per kind; each kind's fields have names (`Event.src_block`,
`Event.block_hashes`, `Event.cached_tokens`, `Event.reason`, ...), so no consumer reads meaning
from a position or from the text. The record itself is flat (kind, step, request, blocks, hashes,
detail, values) because it is what the step stream carries and what a session stores, packed, by
the million. `detail` is text for people (the event log, exports); the numbers and reasons of
ARRIVED, ADMITTED, FINISHED and REJECTED travel in `values` (see VALUES), set by the EventLog
methods of those kinds, which also write their detail (DETAIL_FORMATS).

Where a kind matches a vLLM KV-cache event (vllm/distributed/kv_events.py) its docstring says
so; the fields keep the same meaning, so an external event stream maps onto ours.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass


class EventKind(str, enum.Enum):
    # Block events (the cache manager).
    ALLOCATED = "allocated"
    """Fresh blocks taken from the pool for a request (`blocks`, in table order)."""
    CACHE_HIT = "cache_hit"
    """Cached blocks reused by a request at admission (`blocks`: its table's first blocks, in
    a sliding-window group nulls (-1) first for the blocks before its window)."""
    CACHED = "cached"
    """Full blocks registered under their chain hash: reusable from now on. vLLM's
    BlockStored: `block_hashes` (one per block), `parent_hashes` (each block's chain parent;
    the first block's is the identity root: model, adapter, salt)."""
    EVICTED = "evicted"
    """Cached blocks whose hash was dropped to reuse the block. vLLM's BlockRemoved."""
    FREED = "freed"
    """A request released its blocks (`blocks`, tail first)."""
    OUT_OF_WINDOW = "out_of_window"
    """A sliding-window group released blocks that fell wholly out of its window (`blocks`,
    tail first) while the request runs: its table keeps a null in their place; the blocks keep
    their hashes (cached, evictable). vLLM emits nothing for it (remove_skipped_blocks)."""
    COW = "cow"
    """Copy-on-write: `src_block` copied into `dst_block` before a write."""
    FORKED = "forked"
    """A request was forked: `blocks` (its parent's table: nulls (-1) included in a sliding-window
    group) are now shared with its parent."""
    RESET = "reset"
    """reset_prefix_cache(): `blocks` lost their hash. vLLM's AllBlocksCleared."""
    UNCACHED = "uncached"
    """Hashes withdrawn because the forward pass that was to write their KV failed (`blocks`).
    vLLM's BlockRemoved."""
    # The host tier (kvscope.engine.host_tier): `blocks` of a copy are its sources, then its
    # destinations (`sources`, `destinations`); `hashes` as CACHED's.
    OFFLOADED = "offloaded"
    """Evicted device blocks copied to host blocks under their hashes. vLLM's BlockStored
    with medium "CPU"."""
    LOADED = "loaded"
    """Host blocks copied back into fresh device blocks, registered there under their hashes
    (a prefix hit from the host). vLLM's BlockStored with medium "GPU"."""
    HOST_EVICTED = "host_evicted"
    """Host blocks whose hash was dropped to take another (`blocks`: host blocks). vLLM's
    BlockRemoved with medium "CPU"."""
    # Request events (the scheduler and the engine).
    ARRIVED = "arrived"
    """add_request accepted it into the waiting queue (`prompt_tokens`)."""
    ADMITTED = "admitted"
    """Moved from waiting to running, first time or after a preemption (`cached_tokens`,
    `computed_tokens`: the tokens it found cached and those left to compute)."""
    PREFILL = "prefill"
    """A prompt chunk computed (detail: tokens)."""
    DECODE = "decode"
    """One decode token computed."""
    PREEMPTED = "preempted"
    """Gave its blocks back, to be recomputed later."""
    CANCELLED = "cancelled"
    REJECTED = "rejected"
    """Can never run (`reason`: why)."""
    FINISHED = "finished"
    """`reason`: the finish reason ("error: ..." for a failed forward pass)."""

    __str__ = str.__str__


# The kinds as module names (ev.CACHED, ...), as before the enum.
ALLOCATED = EventKind.ALLOCATED
CACHE_HIT = EventKind.CACHE_HIT
CACHED = EventKind.CACHED
EVICTED = EventKind.EVICTED
FREED = EventKind.FREED
OUT_OF_WINDOW = EventKind.OUT_OF_WINDOW
COW = EventKind.COW
FORKED = EventKind.FORKED
RESET = EventKind.RESET
UNCACHED = EventKind.UNCACHED
OFFLOADED = EventKind.OFFLOADED
LOADED = EventKind.LOADED
HOST_EVICTED = EventKind.HOST_EVICTED
ARRIVED = EventKind.ARRIVED
ADMITTED = EventKind.ADMITTED
PREFILL = EventKind.PREFILL
DECODE = EventKind.DECODE
PREEMPTED = EventKind.PREEMPTED
CANCELLED = EventKind.CANCELLED
REJECTED = EventKind.REJECTED
FINISHED = EventKind.FINISHED

BLOCK_EVENTS = (ALLOCATED, CACHE_HIT, CACHED, EVICTED, FREED, OUT_OF_WINDOW, COW, FORKED, RESET,
                UNCACHED)
HOST_EVENTS = (OFFLOADED, LOADED, HOST_EVICTED)
REQUEST_EVENTS = (ARRIVED, ADMITTED, PREFILL, DECODE, PREEMPTED, CANCELLED, REJECTED, FINISHED)

# The named values each kind carries in `Event.values`, in order.
VALUES: dict[EventKind, tuple[str, ...]] = {
    ARRIVED: ("prompt_tokens",), ADMITTED: ("cached_tokens", "computed_tokens"),
    FINISHED: ("reason",), REJECTED: ("reason",)}
# The detail text of those kinds, written from their values (a session keeps the values packed
# in it: sessions/schema.py unpacks them).
DETAIL_FORMATS: dict[EventKind, str] = {
    ARRIVED: "{} tokens", ADMITTED: "{} cached, {} to compute", FINISHED: "{}", REJECTED: "{}"}


@dataclass(frozen=True, slots=True)
class Event:
    kind: EventKind
    step: int
    request_id: int | None
    blocks: tuple[int, ...] = ()
    time_ns: int = 0  # time.monotonic_ns() when it happened
    hashes: tuple[int, ...] = ()  # CACHED: the blocks' short hashes, then their parents'
    detail: str = ""  # for people: the event log and exports show it
    values: tuple = ()  # the kind's named values (VALUES): read them by name
    group: int = 0  # block events: the KV-cache group whose table the blocks are in
    medium: str = ""  # block events of an attached server's tier below its GPU: its medium

    def _value(self, name: str):
        names = VALUES.get(self.kind, ())
        if name not in names:
            kinds = [str(k) for k, v in VALUES.items() if name in v]
            raise ValueError(f"a {self.kind} event has no {name} (only {', '.join(kinds)})")
        i = names.index(name)
        return self.values[i] if i < len(self.values) else None

    @property
    def prompt_tokens(self) -> int:
        """ARRIVED: the prompt's length in tokens."""
        return self._value("prompt_tokens")

    @property
    def cached_tokens(self) -> int:
        """ADMITTED: prompt tokens found in the cache."""
        return self._value("cached_tokens")

    @property
    def computed_tokens(self) -> int:
        """ADMITTED: tokens left to compute."""
        return self._value("computed_tokens")

    @property
    def reason(self) -> str:
        """FINISHED: the finish reason ("error: ..." for a failed forward pass); REJECTED: why
        it can never run."""
        return self._value("reason")

    def _only(self, kind: EventKind) -> None:
        if self.kind != kind:
            raise ValueError(f"a {self.kind} event has no such field (only {kind} has)")

    @property
    def src_block(self) -> int:
        """COW: the shared block that was copied."""
        self._only(EventKind.COW)
        return self.blocks[0]

    @property
    def dst_block(self) -> int:
        """COW: the request's new private copy."""
        self._only(EventKind.COW)
        return self.blocks[1]

    @property
    def sources(self) -> tuple[int, ...]:
        """OFFLOADED: the device blocks copied; LOADED: the host blocks copied."""
        self._only_copy()
        return self.blocks[:len(self.blocks) // 2]

    @property
    def destinations(self) -> tuple[int, ...]:
        """OFFLOADED: the host blocks written; LOADED: the device blocks written."""
        self._only_copy()
        return self.blocks[len(self.blocks) // 2:]

    def _only_copy(self) -> None:
        if self.kind not in (EventKind.OFFLOADED, EventKind.LOADED):
            raise ValueError(f"a {self.kind} event has no such field (only offloaded and "
                             "loaded have)")

    @property
    def block_hashes(self) -> tuple[int, ...]:
        """CACHED: the short hash of each block (OFFLOADED, LOADED: of each copy)."""
        n = self._num_hashed()
        return self.hashes[:n]

    @property
    def parent_hashes(self) -> tuple[int, ...]:
        """CACHED: the short hash of each block's chain parent (OFFLOADED, LOADED: of each
        copy's)."""
        return self.hashes[self._num_hashed():]

    def _num_hashed(self) -> int:
        if self.kind in (EventKind.OFFLOADED, EventKind.LOADED):
            return len(self.blocks) // 2
        self._only(EventKind.CACHED)
        return len(self.blocks)


class EventLog:
    """An append-only buffer that the producer never waits on; consumers drain it. Bounded: when
    nobody drains it, the oldest events go (counted in `num_dropped`) rather than memory."""

    def __init__(self, enabled: bool = True, capacity: int = 1 << 16):
        self.enabled = enabled
        self._events: deque[Event] = deque(maxlen=capacity)
        self.num_dropped = 0

    def emit(self, kind, step, request_id, blocks=(), hashes=(), detail="", values=(),
             group=0) -> None:
        if self.enabled:
            if len(self._events) == self._events.maxlen:
                self.num_dropped += 1
            self._events.append(
                Event(kind, step, request_id, tuple(blocks), time.monotonic_ns(), tuple(hashes),
                      detail, values, group)
            )

    def _emit_values(self, kind: EventKind, step: int, request_id: int, *values) -> None:
        """A kind with named values (VALUES): its detail is written from them."""
        self.emit(kind, step, request_id, detail=DETAIL_FORMATS[kind].format(*values),
                  values=values)

    def arrived(self, step: int, request_id: int, prompt_tokens: int) -> None:
        self._emit_values(EventKind.ARRIVED, step, request_id, prompt_tokens)

    def admitted(self, step: int, request_id: int, cached_tokens: int,
                 computed_tokens: int) -> None:
        self._emit_values(EventKind.ADMITTED, step, request_id, cached_tokens, computed_tokens)

    def finished(self, step: int, request_id: int, reason: str) -> None:
        self._emit_values(EventKind.FINISHED, step, request_id, reason)

    def rejected(self, step: int, request_id: int, reason: str) -> None:
        self._emit_values(EventKind.REJECTED, step, request_id, reason)

    def cow(self, step: int, request_id: int, src_block: int, dst_block: int,
            group: int = 0) -> None:
        self.emit(EventKind.COW, step, request_id, (src_block, dst_block), group=group)

    def cached(self, step: int, request_id: int, blocks, block_hashes, parent_hashes,
               group: int = 0) -> None:
        self.emit(EventKind.CACHED, step, request_id, blocks,
                  (*block_hashes, *parent_hashes), group=group)

    def drain(self) -> list[Event]:
        events = list(self._events)
        self._events.clear()
        return events

    def __len__(self) -> int:
        return len(self._events)
