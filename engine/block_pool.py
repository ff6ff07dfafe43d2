"""The physical block pool: ref counts, block hashes and the free queue in LRU order.

As in vLLM v1: a block whose ref count drops to zero keeps its hash and waits in the free queue
("cached"); a prefix hit takes it out of the queue in O(1); eviction is lazy, when a fresh block is
popped from the head of the queue. Unlike vLLM, a released block that has no hash goes to the
*head* of the queue: it holds nothing reusable, so it should be reused before any cached block.
"""

from __future__ import annotations

from collections import OrderedDict

from kvscope.engine.block_hash import BlockHash


class NoFreeBlocksError(RuntimeError):
    pass


class PoolCopy:
    """Plain copies of a pool's per-block lists and its eviction order: what a snapshot needs,
    taken in about a millisecond for 16k blocks (Snapshot.from_pool builds from it later)."""

    __slots__ = ("ref_count", "block_hash", "parent_hash", "hits", "last_use", "_order")

    def __init__(self, pool: BlockPool):
        self.ref_count, self.block_hash = pool.ref_count[:], pool.block_hash[:]
        self.parent_hash, self.hits = pool.parent_hash[:], pool.hits[:]
        self.last_use = pool.last_use[:]
        self._order = pool.eviction_order()

    @classmethod
    def from_snapshot(cls, snap, eviction_policy: str = "lru") -> BlockPool:
        """The pool a Snapshot shows (its short hashes as 8-byte keys): where a session's
        replay starts, at a keyframe."""
        if eviction_policy != "lru":
            raise ValueError(f"unknown eviction policy {eviction_policy!r}")
        pool = cls(snap.num_blocks)
        key = [None if h == 0 else int(h).to_bytes(8, "little") for h in snap.block_hash.tolist()]
        parent = [None if k is None else int(p).to_bytes(8, "little")
                  for k, p in zip(key, snap.parent_hash.tolist(), strict=True)]
        pool.ref_count, pool.block_hash, pool.parent_hash = snap.ref_count.tolist(), key, parent
        pool.hits, pool.last_use = snap.hit_count.tolist(), snap.last_use.tolist()
        pool.hash_to_block = {h: b for b, h in enumerate(key) if h is not None}
        queued = sorted((r, b) for b, r in enumerate(snap.lru_rank.tolist()) if r >= 0)
        pool.free_queue = OrderedDict.fromkeys(b for _, b in queued)
        pool.num_cached = sum(key[b] is not None for b in pool.free_queue)
        pool.num_evicted = snap.num_evicted_blocks
        return pool

    def eviction_order(self) -> list[int]:
        return self._order


class BlockPool:
    def __init__(self, num_blocks: int, evicted_history: int = 1 << 18):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.parent_hash: list[BlockHash | None] = [None] * num_blocks  # chain parent, if hashed
        self.hits = [0] * num_blocks  # prefix hits served since the block was cached
        self.last_use = [-1] * num_blocks
        # Head = next block to reuse. Values unused: an OrderedDict is an O(1) linked set.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[BlockHash, int] = {}
        # Hashes dropped from the cache -> (step, "evicted" | "reset"), oldest forgotten first.
        self.dropped: OrderedDict[BlockHash, tuple[int, str]] = OrderedDict()
        self.evicted_history = evicted_history
        self.num_evicted = 0
        self.forgot_any = False  # `dropped` overflowed: a missing hash may have been evicted
        self.num_cached = 0  # blocks in the free queue that keep a hash (evictable)

    @classmethod
    def from_snapshot(cls, snap, eviction_policy: str = "lru") -> BlockPool:
        """The pool a Snapshot shows (its short hashes as 8-byte keys): where a session's
        replay starts, at a keyframe."""
        if eviction_policy != "lru":
            raise ValueError(f"unknown eviction policy {eviction_policy!r}")
        pool = cls(snap.num_blocks)
        key = [None if h == 0 else int(h).to_bytes(8, "little") for h in snap.block_hash.tolist()]
        parent = [None if k is None else int(p).to_bytes(8, "little")
                  for k, p in zip(key, snap.parent_hash.tolist(), strict=True)]
        pool.ref_count, pool.block_hash, pool.parent_hash = snap.ref_count.tolist(), key, parent
        pool.hits, pool.last_use = snap.hit_count.tolist(), snap.last_use.tolist()
        pool.hash_to_block = {h: b for b, h in enumerate(key) if h is not None}
        queued = sorted((r, b) for b, r in enumerate(snap.lru_rank.tolist()) if r >= 0)
        pool.free_queue = OrderedDict.fromkeys(b for _, b in queued)
        pool.num_cached = sum(key[b] is not None for b in pool.free_queue)
        pool.num_evicted = snap.num_evicted_blocks
        return pool

    def eviction_order(self) -> list[int]:
        """The blocks that can be handed out, in the order they would be."""
        return list(self.free_queue)

    def copy(self) -> PoolCopy:
        return PoolCopy(self)

    @property
    def num_available(self) -> int:
        """Blocks that can be handed out now: free ones plus evictable cached ones."""
        return len(self.free_queue)

    def take(self, blocks: list[int], step: int, hit: bool = False) -> None:
        """Add a reference to each block (a prefix hit, counted in `hits`, or a fork); cached
        blocks leave the queue."""
        for b in blocks:
            if self.ref_count[b] == 0:
                del self.free_queue[b]
                self.num_cached -= self.block_hash[b] is not None
            self.ref_count[b] += 1
            self.last_use[b] = step
            self.hits[b] += hit

    def allocate(self, n: int, step: int) -> tuple[list[int], list[int]]:
        """Pop n blocks from the queue head. Returns (blocks, those whose hash was evicted)."""
        if n > len(self.free_queue):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self.free_queue)} available")
        blocks, evicted = [], []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                self._drop_hash(b, h, step, "evicted")
                self.num_cached -= 1
                evicted.append(b)
            self.ref_count[b] = 1
            self.last_use[b] = step
            blocks.append(b)
        self.num_evicted += len(evicted)
        return blocks, evicted

    def release(self, blocks: list[int], step: int) -> None:
        """Drop one reference from each block, in the given order (callers pass tail first)."""
        for b in blocks:
            self.ref_count[b] -= 1
            self.last_use[b] = step
            if self.ref_count[b] == 0:
                self.free_queue[b] = None
                if self.block_hash[b] is None:
                    self.free_queue.move_to_end(b, last=False)
                else:
                    self.num_cached += 1

    def cache(self, block: int, block_hash: BlockHash, parent: BlockHash) -> bool:
        """Register a full block under its hash (`parent`: the hash before it in the chain).
        False if another block already holds that hash (e.g. the recomputed last block of a
        full-prompt hit): the block then stays unhashed."""
        if block_hash in self.hash_to_block:
            return False
        self.hash_to_block[block_hash] = block
        self.block_hash[block] = block_hash
        self.parent_hash[block] = parent
        self.dropped.pop(block_hash, None)
        return True

    def uncache(self, block: int) -> None:
        """Withdraw a hash registered in a step whose forward pass failed: the block's KV was
        never written, so it must never be hit. Not an eviction (nothing reusable is lost)."""
        h = self.block_hash[block]
        if h is None:
            return
        del self.hash_to_block[h]
        self.block_hash[block] = self.parent_hash[block] = None
        self.hits[block] = 0
        if self.ref_count[block] == 0:  # an unhashed free block goes before any cached one
            self.num_cached -= 1
            self.free_queue.move_to_end(block, last=False)

    def reset(self, step: int) -> list[int]:
        """Forget every hash (cached and active blocks alike). Returns the blocks affected."""
        blocks = sorted(self.hash_to_block.values())
        for b in blocks:
            self._drop_hash(b, self.block_hash[b], step, "reset")
        # Blocks that are now plain free go before anything else in the queue.
        for b in reversed(blocks):
            if self.ref_count[b] == 0:
                self.free_queue.move_to_end(b, last=False)
        self.num_cached = 0
        return blocks

    def _drop_hash(self, block: int, block_hash: BlockHash, step: int, why: str) -> None:
        del self.hash_to_block[block_hash]
        self.block_hash[block] = self.parent_hash[block] = None
        self.hits[block] = 0
        self.dropped[block_hash] = (step, why)
        if len(self.dropped) > self.evicted_history:
            self.dropped.popitem(last=False)
            self.forgot_any = True
