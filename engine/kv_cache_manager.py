"""Per-request block tables over the block pool, with prefix caching and copy-on-write.

A request's tokens are "known" (prompt plus generated so far) and a prefix of them is "computed"
(their KV lives in the pool). Full blocks of computed tokens are registered under their chained
hash as soon as their slots are allocated (as vLLM does), so a request admitted later in the same
step can hit them. That is safe because the engine runs every chunk of a step in one packed
forward pass in which each layer stores the K/V of all new tokens before any token attends. If
that forward pass fails, `uncache` withdraws what the step registered for the failed requests:
a block is a hit only once its KV is written.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvscope.engine import events as ev
from kvscope.engine import explain as ex
from kvscope.engine.block_hash import ExtraKeys, hash_blocks, root_hash, short_hash
from kvscope.engine.block_pool import BlockPool, NoFreeBlocksError
from kvscope.engine.snapshot import CacheCounters, PoolState, Snapshot

MAX_KEYS_CHECKED = 16  # extra-key identities compared when explaining a miss


@dataclass(slots=True)
class _Seq:
    token_ids: list[int]
    keys: ExtraKeys
    root: bytes
    hashes: list[bytes]  # chain hashes of the full blocks of token_ids, computed on demand
    table: list[int]
    num_computed: int = 0
    num_registered: int = 0  # leading full blocks already offered to the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 model_fingerprint: str = "", record_events: bool = True,
                 eviction_policy: str = "lru"):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.model_fingerprint = model_fingerprint
        self.pool = BlockPool(num_blocks, eviction_policy=eviction_policy)
        self.events = ev.EventLog(record_events)
        self.step = 0
        self._registered: dict[int, list[int]] = {}  # this step: request -> blocks it registered
        self.seqs: dict[int, _Seq] = {}
        self.explanations: dict[int, ex.MissExplanation] = {}
        self.new_explanations: list[ex.MissExplanation] = []  # made in this step
        self._recent_keys: OrderedDict[ExtraKeys, bytes] = OrderedDict()  # keys -> root hash
        self.hit_tokens = self.query_tokens = 0
        self.num_requests_queried = self.num_requests_hit = 0
        self.num_cow_copies = 0

    # ----------------------------------------------------------------- admission
    def can_admit(self, token_ids: list[int], num_new_tokens: int, cache_salt: str | None = None,
                  adapter: str | None = None) -> bool:
        keys = self._keys(cache_salt, adapter)
        hit = self._lookup(self._chain(keys, token_ids), len(token_ids))
        num_new_tokens = min(num_new_tokens, len(token_ids) - len(hit) * self.block_size)
        return self._admit_cost(hit, num_new_tokens) <= self.pool.num_available

    def admit(self, request_id: int, token_ids: list[int], num_new_tokens: int | None = None,
              cache_salt: str | None = None, adapter: str | None = None,
              count_stats: bool = True, block_hashes: list[bytes] | None = None) -> int | None:
        """Reuse the longest cached prefix of `token_ids` and allocate slots for the next
        `num_new_tokens` tokens (default: the rest of them). Returns the number of tokens served
        from the cache, or None if the pool cannot hold this now (nothing changes then).
        `block_hashes`: the chain hashes of the prompt's full blocks when the caller already
        has them (a trace that gives block ids); token hashing is then skipped."""
        if request_id in self.seqs:
            raise ValueError(f"request {request_id} is already admitted")
        if not token_ids:
            raise ValueError("a request needs at least one token")
        keys = self._keys(cache_salt, adapter)
        if block_hashes is None:
            root, hashes = self._chain(keys, token_ids)
        else:
            root = self._recent_keys.get(keys) or root_hash(keys)
            hashes = list(block_hashes) if self.enable_prefix_caching else []
        hit = self._lookup((root, hashes), len(token_ids))
        num_cached = len(hit) * self.block_size
        if num_new_tokens is None:
            num_new_tokens = len(token_ids) - num_cached
        num_new_tokens = min(num_new_tokens, len(token_ids) - num_cached)
        if self._admit_cost(hit, num_new_tokens) > self.pool.num_available:
            return None
        self.pool.take(hit, self.step, hit=True)
        seq = _Seq(list(token_ids), keys, root, hashes, list(hit), num_cached, len(hit))
        self.seqs[request_id] = seq
        if hit:
            self.events.emit(ev.CACHE_HIT, self.step, request_id, hit)
        if count_stats:
            self.query_tokens += len(token_ids)
            self.hit_tokens += num_cached
            self.num_requests_queried += 1
            self.num_requests_hit += bool(hit)
            why = self._explain(request_id, seq, len(hit))
            self.explanations[request_id] = why
            self.new_explanations.append(why)
        self._remember_keys(keys, root)
        self.allocate(request_id, num_new_tokens)
        return num_cached

    def _admit_cost(self, hit: list[int], num_new_tokens: int) -> int:
        """Blocks the pool must give up: cached blocks taken by the hit plus fresh ones."""
        reused_from_queue = sum(1 for b in hit if self.pool.ref_count[b] == 0)
        end = len(hit) * self.block_size + num_new_tokens
        return reused_from_queue + max(0, -(-end // self.block_size) - len(hit))

    # ------------------------------------------------------------------ running
    def append_token_ids(self, request_id: int, token_ids: list[int]) -> None:
        """New tokens are known (e.g. sampled); their slots come with allocate()."""
        self.seqs[request_id].token_ids.extend(token_ids)

    def can_allocate(self, request_id: int, num_new_tokens: int) -> bool:
        return self._allocate_cost(self.seqs[request_id], num_new_tokens) <= self.pool.num_available

    def allocate(self, request_id: int, num_new_tokens: int) -> list[tuple[int, int]]:
        """Allocate slots for the next `num_new_tokens` known tokens; they count as computed from
        now on. Returns copy-on-write copies (source block, new block) the model runner must make
        before writing KV. Raises NoFreeBlocksError, changing nothing, if the pool is short."""
        seq = self.seqs[request_id]
        end = seq.num_computed + num_new_tokens
        if end > len(seq.token_ids):
            raise ValueError(f"request {request_id}: {end} tokens to compute, "
                             f"only {len(seq.token_ids)} known")
        cost = self._allocate_cost(seq, num_new_tokens)
        if cost > self.pool.num_available:
            raise NoFreeBlocksError(f"request {request_id} needs {cost} blocks, "
                                    f"{self.pool.num_available} available")
        copies = []
        if self._needs_cow(seq, num_new_tokens):
            i = seq.num_computed // self.block_size
            (dst,) = self._fresh(request_id, 1)
            src = seq.table[i]
            self.pool.release([src], self.step)
            seq.table[i] = dst
            copies.append((src, dst))
            self.num_cow_copies += 1
            self.events.cow(self.step, request_id, src, dst)
        need = -(-end // self.block_size) - len(seq.table)
        if need > 0:
            seq.table.extend(self._fresh(request_id, need))
        seq.num_computed = end
        self._register_full_blocks(request_id, seq)
        return copies

    def _allocate_cost(self, seq: _Seq, num_new_tokens: int) -> int:
        end = seq.num_computed + num_new_tokens
        fresh = max(0, -(-end // self.block_size) - len(seq.table))
        return fresh + self._needs_cow(seq, num_new_tokens)

    def _needs_cow(self, seq: _Seq, num_new_tokens: int) -> bool:
        """The next token lands in a partially filled block that another request also holds."""
        i, offset = divmod(seq.num_computed, self.block_size)
        return (num_new_tokens > 0 and offset != 0 and i < len(seq.table)
                and self.pool.ref_count[seq.table[i]] > 1)

    def _fresh(self, request_id: int, n: int) -> list[int]:
        blocks, evicted = self.pool.allocate(n, self.step)
        if evicted:
            self.events.emit(ev.EVICTED, self.step, request_id, evicted)
        self.events.emit(ev.ALLOCATED, self.step, request_id, blocks)
        return blocks

    def _register_full_blocks(self, request_id: int, seq: _Seq) -> None:
        num_full = seq.num_computed // self.block_size
        if num_full <= seq.num_registered:
            return
        if self.enable_prefix_caching:
            if len(seq.hashes) < num_full:
                parent = seq.hashes[-1] if seq.hashes else seq.root
                seq.hashes += hash_blocks(parent, seq.token_ids[: num_full * self.block_size],
                                          self.block_size, len(seq.hashes))
            parents = [seq.root, *seq.hashes]
            cached = [(seq.table[i], seq.hashes[i], parents[i])
                      for i in range(seq.num_registered, num_full)
                      if self.pool.cache(seq.table[i], seq.hashes[i], parents[i], i == 0)]
            if cached:
                self._registered.setdefault(request_id, []).extend(b for b, _, _ in cached)
                if self.events.enabled:
                    self.events.cached(self.step, request_id, [b for b, _, _ in cached],
                                       [short_hash(h) for _, h, _ in cached],
                                       [short_hash(p) for _, _, p in cached])
        seq.num_registered = num_full

    def begin_step(self, step: int) -> None:
        self.step = step
        self._registered.clear()
        self.new_explanations = []

    def uncache(self, request_id: int) -> list[int]:
        """The forward pass that was to write this request's new KV failed: withdraw the hashes
        it registered in this step (their blocks hold no KV). Returns those blocks: any other
        request holding one of them read KV that was never written."""
        blocks = self._registered.pop(request_id, [])
        for b in blocks:
            self.pool.uncache(b)
        if blocks:
            self.events.emit(ev.UNCACHED, self.step, request_id, blocks)
        return blocks

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent by reference (the partial last block too);
        whichever writes first into a shared partial block gets a copy (see allocate)."""
        if child_id in self.seqs:
            raise ValueError(f"request {child_id} is already admitted")
        p = self.seqs[parent_id]
        self.pool.take(p.table, self.step)
        self.seqs[child_id] = _Seq(list(p.token_ids), p.keys, p.root, list(p.hashes),
                                   list(p.table), p.num_computed, p.num_registered)
        self.events.emit(ev.FORKED, self.step, child_id, p.table, detail=f"from {parent_id}")

    def free(self, request_id: int) -> None:
        """Release a request at any phase (finished, cancelled, preempted). Tail first, so the
        end of a chain is evicted before its head."""
        seq = self.seqs.pop(request_id)
        blocks = seq.table[::-1]
        self.pool.release(blocks, self.step)
        if blocks:
            self.events.emit(ev.FREED, self.step, request_id, blocks)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix. Running requests keep their blocks, which just stop being
        reusable; their blocks that fill later are cached again."""
        blocks = self.pool.reset(self.step)
        self.events.emit(ev.RESET, self.step, None, blocks)

    # ----------------------------------------------------------------- queries
    def block_table(self, request_id: int) -> list[int]:
        return self.seqs[request_id].table

    def num_computed_tokens(self, request_id: int) -> int:
        return self.seqs[request_id].num_computed

    def explain_miss(self, request_id: int) -> ex.MissExplanation:
        """Why this request's prompt did not fully hit, as judged when it was admitted."""
        return self.explanations[request_id]

    def counters(self) -> CacheCounters:
        return CacheCounters(self.hit_tokens, self.query_tokens, self.num_requests_queried,
                             self.num_requests_hit, self.pool.num_evicted, self.num_cow_copies)

    def num_computed(self) -> dict[int, int]:
        return {r: s.num_computed for r, s in self.seqs.items()}

    def snapshot(self) -> Snapshot:
        return Snapshot.from_pool(self.pool, {r: s.table for r, s in self.seqs.items()},
                                  self.num_computed(), self.counters(), self.step,
                                  self.block_size)

    def pool_state(self) -> PoolState:
        """A cheap copy of the block state, to be turned into a Snapshot elsewhere."""
        return PoolState(self.step, self.block_size, self.pool.copy(),
                         {r: s.table[:] for r, s in self.seqs.items()}, self.num_computed(),
                         self.counters())

    # ----------------------------------------------------------------- helpers
    def _keys(self, cache_salt: str | None, adapter: str | None) -> ExtraKeys:
        # As vLLM: an empty salt is no salt (it hashes a salt only if it is truthy).
        return ExtraKeys(self.model_fingerprint, adapter, cache_salt or None)

    def _chain(self, keys: ExtraKeys, token_ids: list[int]) -> tuple[bytes, list[bytes]]:
        root = self._recent_keys.get(keys) or root_hash(keys)
        if not self.enable_prefix_caching:
            return root, []
        return root, hash_blocks(root, token_ids, self.block_size)

    def _lookup(self, chain: tuple[bytes, list[bytes]], num_tokens: int) -> list[int]:
        """Physical blocks of the longest cached prefix, leaving the last token to compute."""
        hashes = chain[1][: (num_tokens - 1) // self.block_size]
        hit = []
        for h in hashes:
            b = self.pool.hash_to_block.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def _remember_keys(self, keys: ExtraKeys, root: bytes) -> None:
        self._recent_keys[keys] = root
        self._recent_keys.move_to_end(keys)
        if len(self._recent_keys) > MAX_KEYS_CHECKED:
            self._recent_keys.popitem(last=False)

    def _explain(self, request_id: int, seq: _Seq, num_hit: int) -> ex.MissExplanation:
        n = len(seq.token_ids)
        base = dict(request_id=request_id, num_prompt_tokens=n, block_size=self.block_size,
                    num_hit_blocks=num_hit)
        if not self.enable_prefix_caching:
            return ex.MissExplanation(reason=ex.CACHING_DISABLED, **base)
        if n <= self.block_size:  # no full block before the last token
            return ex.MissExplanation(reason=ex.TOO_SHORT, **base)
        if num_hit == (n - 1) // self.block_size:
            return ex.MissExplanation(reason=ex.FULL_HIT, **base)
        base["first_miss_block"] = num_hit
        h = seq.hashes[num_hit]
        if h in self.pool.dropped:
            step, why = self.pool.dropped[h]
            return ex.MissExplanation(reason=ex.EVICTED, dropped_at_step=step, dropped_by=why,
                                      **base)
        prefix = seq.token_ids[: (num_hit + 1) * self.block_size]
        for keys, root in reversed(self._recent_keys.items()):
            if keys != seq.keys:
                other = hash_blocks(root, prefix, self.block_size)[-1]
                if other in self.pool.hash_to_block or other in self.pool.dropped:
                    return ex.MissExplanation(reason=ex.DIFFERENT_EXTRA_KEYS,
                                              differing_keys=tuple(seq.keys.differing(keys)),
                                              **base)
        if self.pool.forgot_any:
            return ex.MissExplanation(reason=ex.FORGOTTEN, **base)
        return ex.MissExplanation(reason=ex.NEVER_STORED, **base)


__all__ = ["KVCacheManager", "NoFreeBlocksError"]
