"""The physical block pool: ref counts, block hashes, and which free block is reused next.

As in vLLM v1: a block whose ref count drops to zero keeps its hash and waits ("cached"); a prefix
hit takes it back in O(1); eviction is lazy, when a fresh block is needed. Free blocks without a
hash are always reused before any cached block, most recently released first (as vLLM 0.33,
which prepends them to its free queue; earlier versions appended them). Among cached blocks the
eviction policy decides (`kvscope.engine.policies`: lru as vLLM, fifo, lfu). Under a timed
policy (ttl) a cached block also expires `ttl_s` seconds after its release, on the clock the
caller moves with `expire(now)` (a trace's timestamps): its hash is dropped as "expired".

Copies: as vLLM's `BlockHashToBlockMap`, a block that fills with content already cached under the
same hash (a block-aligned prompt that fully hit recomputes its last block; a request filled a
block another one cached meanwhile) is registered too, not left unhashed: a hash may name several
blocks. A lookup takes the earliest registered copy still held; each copy is evicted on its own
(one "evicted" per block, as one BlockRemoved each), and a hash counts as dropped only when its
last copy goes.

Every choice is a deterministic function of the sequence of calls (no wall clock, no randomness), so
replaying recorded calls reproduces it. Each operation is O(1) (lru) or O(log n) (fifo, lfu).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from kvscope.engine.block_hash import BlockHash
from kvscope.engine.kv_groups import group_key
from kvscope.engine.policies import cached_set


class NoFreeBlocksError(RuntimeError):
    pass


class BlockCounts(NamedTuple):
    """The pool's totals: every block is in exactly one of these."""

    free: int  # ref count 0, no hash
    active: int  # ref count >= 1 (shared included)
    cached: int  # ref count 0, hash kept (evictable)


class PoolCopy:
    """Plain copies of a pool's per-block lists and its eviction order: what a snapshot needs,
    taken in about a millisecond for 16k blocks (Snapshot.from_pool builds from it later)."""

    __slots__ = ("ref_count", "block_hash", "parent_hash", "hits", "last_use", "cached_seq",
                 "group", "_order", "_counts")

    def __init__(self, pool: BlockPool):
        self.ref_count, self.block_hash = pool.ref_count[:], pool.block_hash[:]
        self.group = pool.group[:]
        self.parent_hash, self.hits = pool.parent_hash[:], pool.hits[:]
        self.last_use, self.cached_seq = pool.last_use[:], pool.cached_seq[:]
        self._order = pool.eviction_order()
        self._counts = pool.counts()

    def eviction_order(self) -> list[int]:
        return self._order

    def counts(self) -> BlockCounts:
        return self._counts


class BlockPool:
    def __init__(self, num_blocks: int, evicted_history: int = 1 << 18,
                 eviction_policy: str = "lru", ttl_s: float | None = None):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.eviction_policy = eviction_policy
        self.ttl_s = ttl_s  # a timed policy's lifetime after release (None: never expires)
        self.clock = 0.0  # seconds, moved by expire(now): release times are read from it
        self.ref_count = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.parent_hash: list[BlockHash | None] = [None] * num_blocks  # chain parent, if hashed
        self.hits = [0] * num_blocks  # prefix hits served since the block was cached
        self.cached_seq = [0] * num_blocks  # order in which hashes were registered (fifo)
        self._num_registered = 0
        self.last_use = [-1] * num_blocks
        self.group = [0] * num_blocks  # the KV-cache group that last allocated the block
        self.group_used = False  # a group other than 0 has allocated (else group is all 0)
        self.num_held = [0]  # per group: blocks with ref count >= 1 that the group allocated
        # Free blocks without a hash, head = next to reuse; then the cached ones.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached = cached_set(eviction_policy)
        self.hash_to_block: dict[BlockHash, int] = {}  # hash -> the copy a lookup takes
        self.copies: dict[BlockHash, list[int]] = {}  # hash -> its later copies, oldest first
        # Parents of first blocks: chain roots (one per identity), which are never blocks.
        # With them a resident block whose parent is neither resident nor a root is known to be
        # unreachable (see kvscope.engine.dead).
        self.chain_roots: set[BlockHash] = set()
        # Hashes dropped from the cache -> (step, "evicted" | "reset" | "expired", the clock at
        # the block's last release (expired) or None), oldest forgotten first.
        self.dropped: OrderedDict[BlockHash, tuple[int, str, float | None]] = OrderedDict()
        self.evicted_history = evicted_history  # 0: remember none (no miss explanations)
        self.num_evicted = 0
        self.num_expired = 0  # cached blocks whose hash a TTL dropped (not in num_evicted)
        self.forgot_any = False  # `dropped` overflowed: a missing hash may have been evicted
        # When a list (a host tier takes the evicted KV): allocate appends each evicted block's
        # (block, hash, parent, group) to it, for the caller to take and clear.
        self.evicted_keys: list[tuple[int, BlockHash, BlockHash, int]] | None = None
        # Called with each block that becomes free without a hash (a KIVI residual's owner).
        self.on_free: Callable[[int], None] | None = None

    @property
    def num_available(self) -> int:
        """Blocks that can be handed out now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Blocks with ref count 0 that keep a hash (evictable)."""
        return len(self._cached)

    def counts(self) -> BlockCounts:
        """The pool's totals (free, active, cached): the one place they are computed."""
        available, cached = len(self._free) + len(self._cached), len(self._cached)
        return BlockCounts(available - cached, self.num_blocks - available, cached)

    def held_by_group(self, num_groups: int) -> tuple[int, ...]:
        """Blocks held by requests (ref count >= 1) in each of the first `num_groups` groups."""
        return tuple(self.num_held[:num_groups]) + (0,) * (num_groups - len(self.num_held))

    def group_counts(self, num_groups: int) -> tuple[np.ndarray, np.ndarray]:
        """Blocks held (ref count >= 1) and cached (ref count 0, hash kept) in each KV-cache
        group, each block counted in the group that last allocated it."""
        group = np.array(self.group, dtype=np.intp)
        cached = (np.array(self.ref_count) == 0) & np.fromiter(
            (h is not None for h in self.block_hash), bool, self.num_blocks)
        return (np.array(self.held_by_group(num_groups)),
                np.bincount(group[cached], minlength=num_groups))

    def prefix_hit(self, keys) -> list[int]:
        """The blocks holding `keys` (a prompt's chain, in order) from the first, up to a miss:
        a lookup of a chain that needs every block before the point (full attention)."""
        h2b, hit = self.hash_to_block, []
        for k in keys:
            b = h2b.get(k)
            if b is None:
                break
            hit.append(b)
        return hit

    def eviction_order(self) -> list[int]:
        """Every block with ref count 0, in the order they would be reused (a copy)."""
        return [*self._free, *self._cached.order()]

    free_queue = property(eviction_order, doc="The reuse order, as `eviction_order()`.")

    def copy(self) -> PoolCopy:
        return PoolCopy(self)

    def clone(self) -> BlockPool:
        """An independent pool in the same state (C-level copies of its lists and dicts):
        several times cheaper than `from_snapshot`, for replays that restart from one keyframe
        again and again."""
        new = object.__new__(BlockPool)
        new.__dict__.update(self.__dict__)
        for name in ("ref_count", "block_hash", "parent_hash", "hits", "cached_seq", "last_use",
                     "group", "num_held"):
            setattr(new, name, getattr(self, name)[:])
        new._free, new._cached = self._free.copy(), self._cached.clone()
        new.hash_to_block, new.dropped = self.hash_to_block.copy(), self.dropped.copy()
        new.copies = {h: c[:] for h, c in self.copies.items()}
        new.chain_roots = set(self.chain_roots)
        new.evicted_keys = None if self.evicted_keys is None else self.evicted_keys[:]
        new.on_free = None
        return new

    @classmethod
    def from_snapshot(cls, snap, eviction_policy: str = "lru") -> BlockPool:
        """The pool a Snapshot shows, its short hashes as 8-byte keys (a block of group g > 0:
        kv_groups.group_key of it): where a session's replay starts, at a keyframe. Free
        blocks are queued as the snapshot orders them (lru_rank);
        cached ones are released in that order, so every policy rebuilds the same order (fifo:
        by the recorded registration order; lfu: hits, then that order)."""
        pool = cls(snap.num_blocks, eviction_policy=eviction_policy)
        group = snap.block_group.astype(np.int64)  # (files from before groups: none, all 0)
        if len(group) != snap.num_blocks:
            group = np.zeros(snap.num_blocks, np.int64)
        hashed = np.flatnonzero(snap.block_hash != 0).tolist()
        unhashed = np.flatnonzero(snap.block_hash == 0).tolist()
        for name, column in (("block_hash", snap.block_hash), ("parent_hash", snap.parent_hash)):
            raw = column.astype("<u8").tobytes()
            keys = [raw[i : i + 8] for i in range(0, len(raw), 8)]  # every block's, in one go
            for b in unhashed:
                keys[b] = None
            for b in np.flatnonzero(group).tolist():
                if keys[b] is not None:
                    keys[b] = group_key(keys[b], int(group[b]))
            setattr(pool, name, keys)
        pool.group = group.tolist()
        pool.group_used = bool(group.any())
        # (every group a block is in: a take of a cached block counts it in its group)
        pool.num_held = np.bincount(group[snap.ref_count > 0],
                                    minlength=int(group.max(initial=0)) + 1).tolist()
        key = pool.block_hash
        if len(snap.cached_seq):  # copies of a hash: the earliest registered is the one hit
            hashed.sort(key=snap.cached_seq.__getitem__)
        for b in hashed:
            if key[b] in pool.hash_to_block:
                pool.copies.setdefault(key[b], []).append(b)
            else:
                pool.hash_to_block[key[b]] = b
        pool.hits, pool.last_use = snap.hit_count.tolist(), snap.last_use.tolist()
        pool.ref_count = snap.ref_count.tolist()
        if len(snap.cached_seq):  # (sessions recorded before it have none)
            pool.cached_seq = snap.cached_seq.tolist()
            pool._num_registered = max(pool.cached_seq, default=0)
        queued = np.flatnonzero(snap.lru_rank >= 0)
        order = queued[np.argsort(snap.lru_rank[queued], kind="stable")]
        is_hashed = snap.block_hash[order] != 0
        pool._free = OrderedDict.fromkeys(order[~is_hashed].tolist())
        if pool._cached.keeps_release_order:  # release order is the queue, as it is
            pool._cached._queue = OrderedDict.fromkeys(order[is_hashed].tolist())
        else:
            for b in order[is_hashed].tolist():
                pool._cached.push(b, pool)
        pool.num_evicted = snap.num_evicted_blocks
        return pool

    def take(self, blocks: list[int], step: int, hit: bool = False) -> None:
        """Add a reference to each block (a prefix hit, counted in `hits`, or a fork); free
        blocks stop being free."""
        ref_count, last_use, hits = self.ref_count, self.last_use, self.hits
        for b in blocks:
            if ref_count[b] == 0:
                self.num_held[self.group[b]] += 1
                if self.block_hash[b] is None:
                    del self._free[b]
                else:
                    self._cached.remove(b)
            ref_count[b] += 1
            last_use[b] = step
            hits[b] += hit

    def allocate(self, n: int, step: int, group: int = 0) -> tuple[list[int], list[int]]:
        """Take n blocks for a table of KV-cache `group`, plain free ones first. Returns
        (blocks, those whose hash was evicted)."""
        free, cached = self._free, self._cached
        if n > len(free) + len(cached):
            raise NoFreeBlocksError(f"need {n} blocks, {len(free) + len(cached)} available")
        blocks, evicted = [], []
        ref_count, last_use, block_hash, hash_to_block, pop = self.ref_count, self.last_use, \
            self.block_hash, self.hash_to_block, cached.pop
        remember = self.dropped if self.evicted_history else None
        copies, keys = self.copies, self.evicted_keys
        for _ in range(n):
            if free:
                b = free.popitem(last=False)[0]
            else:  # _drop_hash, inlined: this loop is the trace lab's hot path
                b = pop()
                h = block_hash[b]
                if keys is not None:
                    keys.append((b, h, self.parent_hash[b], self.group[b]))
                if h in copies:
                    self._unregister(b, h)
                else:
                    del hash_to_block[h]
                    if remember is not None:
                        remember[h] = (step, "evicted", None)
                block_hash[b] = self.parent_hash[b] = None
                self.hits[b] = 0
                evicted.append(b)
            ref_count[b] = 1
            last_use[b] = step
            blocks.append(b)
        if group or self.group_used:
            self.group_used = True
            for b in blocks:
                self.group[b] = group
            if group >= len(self.num_held):
                self.num_held += [0] * (group + 1 - len(self.num_held))
        self.num_held[group] += n
        if evicted:
            self.num_evicted += len(evicted)
            self._forget_oldest_dropped()
        return blocks, evicted

    def release(self, blocks: list[int], step: int) -> None:
        """Drop one reference from each block, in the given order (callers pass tail first)."""
        ref_count, last_use = self.ref_count, self.last_use
        for b in blocks:
            ref_count[b] -= 1
            last_use[b] = step
            if ref_count[b] == 0:
                self.num_held[self.group[b]] -= 1
                if self.block_hash[b] is None:
                    self._free[b] = None
                    self._free.move_to_end(b, last=False)
                    if self.on_free is not None:
                        self.on_free(b)
                else:
                    self._cached.push(b, self)

    def cache(self, block: int, block_hash: BlockHash, parent: BlockHash,
              first: bool = False) -> bool:
        """Register a held block under its hash (`parent`: the hash before it in the chain;
        `first`: the block opens its chain, so `parent` is a root, not a block). A hash other
        blocks already hold gets this block as one more copy (see the module docstring).
        False only if the block already holds a hash (nothing changes then)."""
        if first:
            self.chain_roots.add(parent)
        if self.block_hash[block] is not None:
            return False
        if block_hash in self.hash_to_block:
            self.copies.setdefault(block_hash, []).append(block)
        else:
            self.hash_to_block[block_hash] = block
        self.block_hash[block] = block_hash
        self.parent_hash[block] = parent
        self._num_registered += 1
        self.cached_seq[block] = self._num_registered
        if self.dropped:
            self.dropped.pop(block_hash, None)
        return True

    def uncache(self, block: int) -> None:
        """Withdraw a hash registered in a step whose forward pass failed: the block's KV was
        never written, so it must never be hit. Not an eviction (nothing reusable is lost)."""
        h = self.block_hash[block]
        if h is None:
            return
        self._unregister(block, h)
        self.block_hash[block] = self.parent_hash[block] = None
        self.hits[block] = 0
        if self.ref_count[block] == 0:  # an unhashed free block goes before any cached one
            self._cached.remove(block)
            self._free[block] = None
            self._free.move_to_end(block, last=False)

    def reset(self, step: int) -> list[int]:
        """Forget every hash (cached and active blocks alike). Returns the blocks affected."""
        blocks = sorted(b for b, h in enumerate(self.block_hash) if h is not None)
        for b in blocks:
            self._drop_hash(b, self.block_hash[b], step, "reset")
        # Blocks that are now plain free go before anything else, lowest id first.
        self._cached = cached_set(self.eviction_policy)
        for b in reversed(blocks):
            if self.ref_count[b] == 0:
                self._free[b] = None
                self._free.move_to_end(b, last=False)
        return blocks

    def expire(self, now: float, step: int) -> list[int]:
        """Move the clock to `now` (seconds; never back) and, under a timed policy with a TTL,
        drop the hash of every cached block released more than ttl_s before it: they become
        plain free blocks. Returns them."""
        self.clock = max(self.clock, now)
        if self.ttl_s is None or not hasattr(self._cached, "expired"):
            return []
        expired = self._cached.expired(self.clock, self.ttl_s)
        for b, released in expired:
            self._drop_hash(b, self.block_hash[b], step, "expired", released)
            self._free[b] = None
            self._free.move_to_end(b, last=False)
        self.num_expired += len(expired)
        return [b for b, _ in expired]

    def _drop_hash(self, block: int, block_hash: BlockHash, step: int, why: str,
                   released: float | None = None) -> None:
        if not self._unregister(block, block_hash):
            self.dropped[block_hash] = (step, why, released)
            self._forget_oldest_dropped()
        self.block_hash[block] = self.parent_hash[block] = None
        self.hits[block] = 0

    def _unregister(self, block: int, block_hash: BlockHash) -> bool:
        """Take `block` off its hash's copies; True if another copy still holds the hash."""
        more = self.copies.get(block_hash)
        if more is None:
            del self.hash_to_block[block_hash]
            return False
        if self.hash_to_block[block_hash] == block:
            self.hash_to_block[block_hash] = more.pop(0)
        else:
            more.remove(block)
        if not more:
            del self.copies[block_hash]
        return True

    def _forget_oldest_dropped(self) -> None:
        while len(self.dropped) > self.evicted_history:
            self.dropped.popitem(last=False)
            self.forgot_any = True
