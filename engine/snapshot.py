"""The Snapshot: the one state type that every view renders, live or replayed. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from kvscope.engine.kv_groups import NULL, ONE_GROUP, KVGroup

# Block state codes (uint8), also the index into the GUI's colour lookup table.
FREE, ACTIVE, SHARED, CACHED = 0, 1, 2, 3
STATE_NAMES = ("free", "active", "shared", "cached")


class HitRates:
    """Cache hit rates from the counters a Snapshot and a workload's RunSummary both carry:
    hit_tokens, query_tokens, num_requests_hit, num_requests_queried."""

    @property
    def token_hit_rate(self) -> float:
        """Share of looked-up prompt tokens that were served from the cache."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def request_hit_rate(self) -> float:
        """Share of admitted requests that reused at least one cached block."""
        n = self.num_requests_queried
        return self.num_requests_hit / n if n else 0.0


@dataclass(frozen=True, slots=True)
class CacheCounters(HitRates):
    """The cache's running totals since the engine started: one value in every Snapshot, every
    StepUpdate, the session schema and the recorder."""

    hit_tokens: int = 0  # prompt tokens served from the cache
    query_tokens: int = 0  # prompt tokens looked up
    num_requests_queried: int = 0
    num_requests_hit: int = 0  # requests with at least one block served from the cache
    num_evicted_blocks: int = 0
    num_cow_copies: int = 0
    # The host tier (engine.host_tier; all 0 without one): of hit_tokens, those loaded back
    # from it; device blocks copied to it when evicted; host blocks copied back; host blocks
    # whose hash it dropped to take another
    host_hit_tokens: int = 0
    num_offloaded_blocks: int = 0
    num_loaded_blocks: int = 0
    num_host_evicted_blocks: int = 0

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def as_tuple(self) -> tuple[int, ...]:
        return tuple(getattr(self, n) for n in self.names())


@dataclass
class Snapshot:
    step: int
    block_size: int
    state: np.ndarray  # uint8 [num_blocks]: FREE / ACTIVE / SHARED / CACHED
    ref_count: np.ndarray  # int32 [num_blocks]
    owner: np.ndarray  # int64 [num_blocks]: lowest request id holding the block, -1 if none
    block_hash: np.ndarray  # uint64 [num_blocks]: short hash, 0 if the block has none
    last_use: np.ndarray  # int64 [num_blocks]: step of last allocation/hit/release, -1 never
    lru_rank: np.ndarray  # int32 [num_blocks]: 0 = next block to be reused (in the eviction
    #                       policy's order); -1 if held
    parent_hash: np.ndarray  # uint64 [num_blocks]: short hash of the chain parent (the root of
    #                          the identity for a first block), 0 if the block has no hash
    hit_count: np.ndarray  # int32 [num_blocks]: prefix hits served since the block was cached
    block_tables: dict[int, np.ndarray] = field(default_factory=dict)  # request -> int32 ids
    num_computed_tokens: dict[int, int] = field(default_factory=dict)  # request -> tokens in KV
    num_free_blocks: int = 0  # ref 0, no hash
    num_active_blocks: int = 0  # ref >= 1 (shared included)
    num_cached_blocks: int = 0  # ref 0, hash kept, evictable
    num_shared_blocks: int = 0  # ref >= 2
    counters: CacheCounters = field(default_factory=CacheCounters)
    cached_seq: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # int64
    #   [num_blocks]: order in which each block's hash was registered (the fifo policy's key)
    # KV-cache groups (kv_groups): the model's groups; each block's (uint8 [num_blocks], the
    # group that last allocated it); and the tables of groups 1.. (block_tables is group 0's),
    # NULL (-1) where a sliding window released a block
    groups: tuple[KVGroup, ...] = ONE_GROUP
    block_group: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    more_tables: tuple[dict[int, np.ndarray], ...] = ()
    # The host tier (engine.host_tier): its pool as a snapshot of its own (no tables; ACTIVE:
    # held while it is loaded from; its counters count its evictions); None: no host tier.
    # An attached server's tiers below its GPU's hang one under another (GPU -> CPU -> STORAGE):
    # see `tiers`.
    host: Snapshot | None = None
    # An attached server's tier: vLLM's medium ("GPU", "CPU", "STORAGE"; "" for an engine's own
    # pools) and the forms of its stores seen (kv_events.mirror: "placeholder", "self-describing")
    medium: str = ""
    forms: tuple[str, ...] = ()

    # The counters' totals, as before they were grouped.
    hit_tokens = property(lambda self: self.counters.hit_tokens)
    query_tokens = property(lambda self: self.counters.query_tokens)
    num_requests_queried = property(lambda self: self.counters.num_requests_queried)
    num_requests_hit = property(lambda self: self.counters.num_requests_hit)
    num_evicted_blocks = property(lambda self: self.counters.num_evicted_blocks)
    num_cow_copies = property(lambda self: self.counters.num_cow_copies)
    token_hit_rate = property(lambda self: self.counters.token_hit_rate)
    request_hit_rate = property(lambda self: self.counters.request_hit_rate)

    @property
    def num_blocks(self) -> int:
        return len(self.state)

    def tiers(self) -> list[Snapshot]:
        """This pool and each tier below it (`host`, its `host`, ...), top first."""
        out, s = [], self
        while s is not None:
            out.append(s)
            s = s.host
        return out

    def tables_of(self, request_id: int) -> list[np.ndarray]:
        """The request's block table in each group (NULL: released out of a window)."""
        return [self.block_tables[request_id], *(t[request_id] for t in self.more_tables)]

    @classmethod
    def from_pool(cls, pool, tables: dict[int, list[int]], num_computed_tokens: dict[int, int],
                  counters: CacheCounters, step: int, block_size: int,
                  groups: tuple[KVGroup, ...] = ONE_GROUP,
                  more_tables: tuple[dict[int, list[int]], ...] = (),
                  host: tuple[object, int] | None = None) -> Snapshot:
        """The one snapshot builder: from a BlockPool (live, or driven by recorded events in a
        replay) or a PoolCopy of one, and the requests' block tables (group 0's in `tables`,
        the other groups' in `more_tables`); `host`: the host tier's pool (or a copy) and its
        number of evictions."""
        n = len(pool.ref_count)
        ref = np.array(pool.ref_count, dtype=np.int32)
        block_hash = short_hashes(pool.block_hash)
        hashed = block_hash != 0
        state = np.full(n, FREE, dtype=np.uint8)
        state[hashed] = CACHED
        state[ref >= 1] = ACTIVE
        state[ref >= 2] = SHARED
        order = pool.eviction_order()
        lru_rank = np.full(n, -1, dtype=np.int32)
        lru_rank[np.fromiter(order, dtype=np.int64, count=len(order))] = \
            np.arange(len(order), dtype=np.int32)
        owner = np.full(n, -1, dtype=np.int64)
        for group_tables in (*more_tables, tables):
            for rid in sorted(group_tables, reverse=True):  # the lowest id ends up the owner
                t = group_tables[rid]
                owner[[b for b in t if b != NULL] if NULL in t else t] = rid
        counts = pool.counts()
        return cls(
            step=step, block_size=block_size, state=state, ref_count=ref, owner=owner,
            block_hash=block_hash, last_use=np.array(pool.last_use, dtype=np.int64),
            lru_rank=lru_rank, parent_hash=short_hashes(pool.parent_hash),
            hit_count=np.array(pool.hits, dtype=np.int32),
            block_tables={r: np.array(t, dtype=np.int32) for r, t in tables.items()},
            num_computed_tokens=dict(num_computed_tokens),
            num_free_blocks=counts.free, num_active_blocks=counts.active,
            num_cached_blocks=counts.cached, num_shared_blocks=int((ref >= 2).sum()),
            counters=counters, cached_seq=np.array(pool.cached_seq, dtype=np.int64),
            groups=tuple(groups), block_group=np.array(pool.group, dtype=np.uint8),
            more_tables=tuple({r: np.array(t, dtype=np.int32) for r, t in g.items()}
                              for g in more_tables),
            host=None if host is None else tier_snapshot(host[0], host[1], step, block_size))

    def equals(self, other: Snapshot) -> bool:
        """Field-by-field equality, arrays compared element-wise."""
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, np.ndarray):
                if a.dtype != b.dtype or not np.array_equal(a, b):
                    return False
            elif f.name == "host":
                if (a is None) != (b is None) or (a is not None and not a.equals(b)):
                    return False
            elif f.name in ("block_tables", "more_tables"):
                pairs = [(a, b)] if f.name == "block_tables" else zip(a, b, strict=False)
                if len(a) != len(b) or any(x.keys() != y.keys() or any(
                        not np.array_equal(x[k], y[k]) for k in x) for x, y in pairs):
                    return False
            elif a != b:
                return False
        return True


def tier_snapshot(pool, num_evicted: int, step: int, block_size: int,
                  groups: tuple[KVGroup, ...] = ONE_GROUP, medium: str = "",
                  forms: tuple[str, ...] = ()) -> Snapshot:
    """A tier below another (a host tier; an attached server's CPU or STORAGE) as a snapshot
    of its own: no tables; its counters count its evictions."""
    snap = Snapshot.from_pool(pool, {}, {}, CacheCounters(num_evicted_blocks=num_evicted), step,
                              block_size, groups)
    snap.medium, snap.forms = medium, tuple(forms)
    return snap


_NO_HASH = bytes(8)


def short_hashes(hashes) -> np.ndarray:
    """The short hash (first 8 bytes, little-endian; see block_hash.short_hash) of each block
    hash, 0 for None: vectorised."""
    first = next((h for h in hashes if h is not None), None)
    short = b""
    if first is not None and len(first) == 8:  # a replay's keys are short hashes already
        short = b"".join([h or _NO_HASH for h in hashes])
    if len(short) != 8 * len(hashes):
        short = b"".join([_NO_HASH if h is None else h[:8] for h in hashes])
    return np.frombuffer(short, dtype="<u8").astype(np.uint64)


@dataclass
class PoolState:
    """The block state at the end of a step as plain copies (cheap to take on the engine's
    thread: C-level list copies); `snapshot()` builds the Snapshot later, anywhere."""

    step: int
    block_size: int
    pool: object  # a block_pool.PoolCopy
    tables: dict[int, list[int]]  # group 0's
    num_computed_tokens: dict[int, int]
    counters: CacheCounters
    groups: tuple[KVGroup, ...] = ONE_GROUP
    more_tables: tuple[dict[int, list[int]], ...] = ()  # groups 1..'s
    host: tuple[object, int] | None = None  # the host tier's PoolCopy and evictions

    def snapshot(self) -> Snapshot:
        return Snapshot.from_pool(self.pool, self.tables, self.num_computed_tokens,
                                  self.counters, self.step, self.block_size, self.groups,
                                  self.more_tables, self.host)
