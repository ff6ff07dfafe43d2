"""The Snapshot: the one state type that every view renders, live or replayed. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

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


@dataclass
class Snapshot(HitRates):
    step: int
    block_size: int
    state: np.ndarray  # uint8 [num_blocks]: FREE / ACTIVE / SHARED / CACHED
    ref_count: np.ndarray  # int32 [num_blocks]
    owner: np.ndarray  # int64 [num_blocks]: lowest request id holding the block, -1 if none
    block_hash: np.ndarray  # uint64 [num_blocks]: short hash, 0 if the block has none
    last_use: np.ndarray  # int64 [num_blocks]: step of last allocation/hit/release, -1 never
    lru_rank: np.ndarray  # int32 [num_blocks]: 0 = next block to be reused; -1 if held
    parent_hash: np.ndarray  # uint64 [num_blocks]: short hash of the chain parent (the root of
    #                          the identity for a first block), 0 if the block has no hash
    hit_count: np.ndarray  # int32 [num_blocks]: prefix hits served since the block was cached
    block_tables: dict[int, np.ndarray] = field(default_factory=dict)  # request -> int32 ids
    num_computed_tokens: dict[int, int] = field(default_factory=dict)  # request -> tokens in KV
    num_free_blocks: int = 0  # ref 0, no hash
    num_active_blocks: int = 0  # ref >= 1 (shared included)
    num_cached_blocks: int = 0  # ref 0, hash kept, evictable
    num_shared_blocks: int = 0  # ref >= 2
    hit_tokens: int = 0  # prompt tokens served from the cache
    query_tokens: int = 0  # prompt tokens looked up
    num_requests_queried: int = 0
    num_requests_hit: int = 0  # requests with at least one block served from the cache
    num_evicted_blocks: int = 0
    num_cow_copies: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.state)

    def equals(self, other: Snapshot) -> bool:
        """Field-by-field equality, arrays compared element-wise."""
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, np.ndarray):
                if a.dtype != b.dtype or not np.array_equal(a, b):
                    return False
            elif isinstance(a, dict) and f.name == "block_tables":
                if a.keys() != b.keys() or any(not np.array_equal(a[k], b[k]) for k in a):
                    return False
            elif a != b:
                return False
        return True
