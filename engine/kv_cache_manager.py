"""Per-request block tables over the block pool, with prefix caching and copy-on-write.

A request's tokens are "known" (prompt plus generated so far) and a prefix of them is "computed"
(their KV lives in the pool). Full blocks of computed tokens are registered under their chained
hash as soon as their slots are allocated (as vLLM does), so a request admitted later in the same
step can hit them. That is safe because the engine runs every chunk of a step in one packed
forward pass in which each layer stores the K/V of all new tokens before any token attends. If
that forward pass fails, `uncache` withdraws what the step registered for the failed requests:
a block is a hit only once its KV is written.

KV-cache groups (`kvscope.engine.kv_groups`): a request has one block table per group, all
drawing from the one pool; hashes are stored per group; a sliding-window group releases the
blocks that leave its window (a NULL stays in the table) and a hit is the length every group
accepts, as vLLM's HybridKVCacheCoordinator computes it.

A host tier (`kvscope.engine.host_tier`) widens every lookup: a (group, hash) is cached when a
device block or a host block holds it, the device preferred. Each group's hit is its device
blocks, then the blocks it loads from the host (one split per group, as vLLM loads what follows
the device's hit from its offloading tier): full attention every block of the prefix, a
sliding-window group only those of its window at the hit's end.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvscope.engine import events as ev
from kvscope.engine import explain as ex
from kvscope.engine.admission_misses import explain_admission
from kvscope.engine.block_hash import ExtraKeys, hash_blocks, root_hash, short_hash
from kvscope.engine.block_pool import BlockPool, NoFreeBlocksError
from kvscope.engine.host_tier import HostTier
from kvscope.engine.kv_groups import NULL, ONE_GROUP, KVGroup, group_key
from kvscope.engine.snapshot import CacheCounters, PoolState, Snapshot

MAX_KEYS_CHECKED = 16  # extra-key identities compared when explaining a miss
LOAD = -2  # in a lookup's hit: a block to load from the host tier (never in a block table)


@dataclass(slots=True)
class _Seq:
    token_ids: list[int]
    keys: ExtraKeys
    root: bytes
    hashes: list[bytes]  # chain hashes of the full blocks of token_ids, computed on demand
    tables: list[list[int]]  # one block table per group (NULL: released out of a window)
    num_computed: int = 0
    num_registered: int = 0  # leading full blocks already offered to the cache
    host_tokens: int = 0  # of the prompt's cached tokens, those loaded from the host tier


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 model_fingerprint: str = "", record_events: bool = True,
                 eviction_policy: str = "lru", groups: tuple[KVGroup, ...] = ONE_GROUP,
                 host_blocks: int = 0, host_eviction_policy: str = "lru", ttl_s=None):
        """host_blocks: a host tier (engine.host_tier); ttl_s: the ttl policy's (advance_clock)"""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.groups = tuple(groups) or ONE_GROUP
        # vLLM's lookup order: full-attention groups first (a tight first bound)
        self._lookup_order = sorted(range(len(self.groups)),
                                    key=lambda g: self.groups[g].window is not None)
        self.enable_prefix_caching = enable_prefix_caching
        self.model_fingerprint = model_fingerprint
        self.pool = BlockPool(num_blocks, eviction_policy=eviction_policy, ttl_s=ttl_s)
        self.events = ev.EventLog(record_events)
        self.host = (HostTier(host_blocks, self.pool, self.events, host_eviction_policy)
                     if host_blocks else None)
        self.step = 0
        self._registered: dict[int, list[int]] = {}  # this step: request -> blocks it registered
        self.num_window_freed = 0  # this step: blocks released out of a sliding window
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
        chain = self._chain(keys, token_ids)
        num_hit, hit, _ = self._lookup(chain, len(token_ids))
        num_cached = num_hit * self.block_size
        num_new_tokens = min(num_new_tokens, len(token_ids) - num_cached)
        return self._admit_cost(hit, num_cached, num_new_tokens) <= self.pool.num_available

    def cached_tokens(self, num_tokens: int, block_hashes: list[bytes]) -> int:
        """The tokens admit() would serve from the cache now (both tiers) for a prompt of
        num_tokens whose full blocks have these chain hashes; changes nothing (a router's look
        at a replica)."""
        if not self.enable_prefix_caching:
            return 0
        num_hit, _, _ = self._lookup((b"", block_hashes), num_tokens)
        return num_hit * self.block_size

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
        num_hit, hit, group_hits = self._lookup((root, hashes), len(token_ids))
        num_cached = num_hit * self.block_size
        if num_new_tokens is None:
            num_new_tokens = len(token_ids) - num_cached
        num_new_tokens = min(num_new_tokens, len(token_ids) - num_cached)
        if self._admit_cost(hit, num_cached, num_new_tokens) > self.pool.num_available:
            return None
        tables, loads = [], []
        for g, group in enumerate(self.groups):
            # As vLLM's add_local_computed_blocks: the hit's blocks before the window are not
            # taken (nulls in the table); the rest are, or are loaded from the host after them.
            skip = min(group.skipped_tokens(num_cached) // self.block_size, len(hit[g]))
            table = [b for b in [NULL] * skip + hit[g][skip:] if b != LOAD]
            self.pool.take([b for b in table if b != NULL], self.step, hit=True)
            if table:  # (a table of nulls too: a replay rebuilds it from the event)
                self.events.emit(ev.CACHE_HIT, self.step, request_id, table, group=g)
            tables.append(table)
            if len(table) < num_hit:
                loads.append(g)
        # a token is served from the host when a group loads its block (every group's loads
        # end at the hit's end: the group that loads most says how many)
        host_tokens = max((num_hit - len(tables[g]) for g in loads), default=0)
        if loads:
            for g, dst in self._load_from_host(request_id, loads, tables, root, hashes,
                                               num_hit).items():
                tables[g] += dst
        seq = _Seq(list(token_ids), keys, root, hashes, tables, num_cached, num_hit,
                   host_tokens * self.block_size)
        self.seqs[request_id] = seq
        if count_stats:
            self.query_tokens += len(token_ids)
            self.hit_tokens += num_cached
            self.num_requests_queried += 1
            self.num_requests_hit += bool(num_hit)
            if loads:
                self.host.hit_tokens += seq.host_tokens
            why = explain_admission(self, request_id, seq, num_hit, group_hits)
            self.explanations[request_id] = why
            self.new_explanations.append(why)
        self._remember_keys(keys, root)
        self.allocate(request_id, num_new_tokens)
        return num_cached

    def _load_from_host(self, request_id: int, loads: list[int], tables: list[list[int]],
                        root: bytes, hashes: list[bytes], end: int) -> dict[int, list[int]]:
        """Fresh device blocks for the host blocks each group in `loads` hit, from the end of
        its table to `end`, registered under their keys; the copies are queued (a failed
        forward withdraws them as its own). Every group's host blocks are held before any
        device block is allocated (whose evictions offload to the host), and those offloads
        are made after the last LOADED event. Returns each group's fresh blocks."""
        parents, h2b = [root, *hashes], self.host.pool.hash_to_block
        todo = []
        for g in loads:
            start = len(tables[g])
            keys = [group_key(h, g) for h in hashes[start:end]]
            todo.append((g, start, keys, [h2b[k] for k in keys]))
            self.host.hold(self.step, todo[-1][3])
        loaded = {}
        for g, start, keys, src in todo:
            dst = self._fresh(request_id, len(src), g, offload=False)
            self.host.load(self.step, request_id, src, dst, keys,
                           [group_key(p, g) for p in parents[start:end]], start == 0, g)
            loaded[g] = dst
            self._registered.setdefault(request_id, []).extend(dst)
        self.host.offload_evicted(self.step, request_id)
        return loaded

    def _admit_cost(self, hit: list[list[int]], num_cached: int, num_new_tokens: int) -> int:
        """Blocks the pool must give up: cached blocks taken by the hit plus fresh ones."""
        bs, ref = self.block_size, self.pool.ref_count
        end_blocks = -(-(num_cached + num_new_tokens) // bs)
        cost = 0
        for g, group in enumerate(self.groups):
            skip = group.skipped_tokens(num_cached) // bs
            cost += sum(1 for b in hit[g][skip:] if b == LOAD or b >= 0 and ref[b] == 0)
            cost += max(0, end_blocks - max(skip, len(hit[g])))
        return cost

    # ------------------------------------------------------------------ running
    def append_token_ids(self, request_id: int, token_ids: list[int]) -> None:
        """New tokens are known (e.g. sampled); their slots come with allocate()."""
        self.seqs[request_id].token_ids.extend(token_ids)

    def can_allocate(self, request_id: int, num_new_tokens: int) -> bool:
        seq = self.seqs[request_id]
        self._release_out_of_window(request_id, seq)
        return self._allocate_cost(seq, num_new_tokens) <= self.pool.num_available

    def allocate(self, request_id: int, num_new_tokens: int) -> list[tuple[int, int]]:
        """Allocate slots for the next `num_new_tokens` known tokens; they count as computed from
        now on. Returns copy-on-write copies (source block, new block) the model runner must make
        before writing KV. Raises NoFreeBlocksError, changing nothing but the release of blocks
        out of a window, if the pool is short."""
        seq = self.seqs[request_id]
        end = seq.num_computed + num_new_tokens
        if end > len(seq.token_ids):
            raise ValueError(f"request {request_id}: {end} tokens to compute, "
                             f"only {len(seq.token_ids)} known")
        self._release_out_of_window(request_id, seq)
        cost = self._allocate_cost(seq, num_new_tokens)
        if cost > self.pool.num_available:
            raise NoFreeBlocksError(f"request {request_id} needs {cost} blocks, "
                                    f"{self.pool.num_available} available")
        copies = []
        i = seq.num_computed // self.block_size
        for g, table in enumerate(seq.tables):
            if self._needs_cow(table, seq.num_computed, num_new_tokens):
                (dst,) = self._fresh(request_id, 1, g)
                src = table[i]
                self.pool.release([src], self.step)
                table[i] = dst
                copies.append((src, dst))
                self.num_cow_copies += 1
                self.events.cow(self.step, request_id, src, dst, group=g)
        need = -(-end // self.block_size)
        for g, table in enumerate(seq.tables):
            if need > len(table):
                table.extend(self._fresh(request_id, need - len(table), g))
        seq.num_computed = end
        self._register_full_blocks(request_id, seq)
        return copies

    def _release_out_of_window(self, request_id: int, seq: _Seq) -> None:
        """As vLLM's remove_skipped_blocks: a sliding-window group gives back the blocks wholly
        before the window of the next token, tail first, each replaced by NULL in the table.
        They keep their hashes (cached, evictable), so a later request may still hit them."""
        for g, group in enumerate(self.groups):
            if group.window is None:
                continue
            table = seq.tables[g]
            skip = min(group.skipped_tokens(seq.num_computed) // self.block_size, len(table))
            released = []
            for i in range(skip - 1, -1, -1):
                if table[i] == NULL:
                    break
                released.append(table[i])
                table[i] = NULL
            if released:
                self.num_window_freed += len(released)
                self.pool.release(released, self.step)
                self.events.emit(ev.OUT_OF_WINDOW, self.step, request_id, released, group=g)

    def _allocate_cost(self, seq: _Seq, num_new_tokens: int) -> int:
        need = -(-(seq.num_computed + num_new_tokens) // self.block_size)
        return sum(max(0, need - len(t)) + self._needs_cow(t, seq.num_computed, num_new_tokens)
                   for t in seq.tables)

    def _needs_cow(self, table: list[int], num_computed: int, num_new_tokens: int) -> bool:
        """The next token lands in a partially filled block that another request also holds."""
        i, offset = divmod(num_computed, self.block_size)
        return (num_new_tokens > 0 and offset != 0 and i < len(table) and table[i] != NULL
                and self.pool.ref_count[table[i]] > 1)

    def _fresh(self, request_id: int, n: int, group: int = 0, offload: bool = True) -> list[int]:
        blocks, evicted = self.pool.allocate(n, self.step, group)
        if evicted:
            self.events.emit(ev.EVICTED, self.step, request_id, evicted, group=group)
            if self.host is not None and offload:
                self.host.offload_evicted(self.step, request_id)
        self.events.emit(ev.ALLOCATED, self.step, request_id, blocks, group=group)
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
            for g, table in enumerate(seq.tables):
                cached = [(table[i], seq.hashes[i], parents[i])
                          for i in range(seq.num_registered, num_full)
                          if table[i] != NULL and self.pool.cache(
                              table[i], group_key(seq.hashes[i], g),
                              group_key(parents[i], g), i == 0)]
                if cached:
                    self._registered.setdefault(request_id, []).extend(b for b, _, _ in cached)
                    if self.events.enabled:
                        self.events.cached(self.step, request_id, [b for b, _, _ in cached],
                                           [short_hash(h) for _, h, _ in cached],
                                           [short_hash(p) for _, _, p in cached], group=g)
        seq.num_registered = num_full

    def begin_step(self, step: int) -> None:
        self.step = step
        if self.host is not None:
            self.host.begin_step(step)
        self.num_window_freed = 0
        self._registered.clear()
        self.new_explanations = []

    def advance_clock(self, now: float) -> None:
        """Move the pool's clock to `now` (seconds); drop what a TTL expired by then."""
        if expired := self.pool.expire(now, self.step):
            self.events.emit(ev.EVICTED, self.step, None, expired, detail="expired")

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
        for g, table in enumerate(p.tables):
            self.pool.take([b for b in table if b != NULL], self.step)
            self.events.emit(ev.FORKED, self.step, child_id, table, detail=f"from {parent_id}",
                             group=g)
        self.seqs[child_id] = _Seq(list(p.token_ids), p.keys, p.root, list(p.hashes),
                                   [t[:] for t in p.tables], p.num_computed, p.num_registered)

    def free(self, request_id: int) -> None:
        """Release a request at any phase (finished, cancelled, preempted), group by group. Tail
        first, so the end of a chain is evicted before its head."""
        seq = self.seqs.pop(request_id)
        for g, table in enumerate(seq.tables):
            blocks = [b for b in reversed(table) if b != NULL]
            self.pool.release(blocks, self.step)
            if blocks:
                self.events.emit(ev.FREED, self.step, request_id, blocks, group=g)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix. Running requests keep their blocks, which just stop being
        reusable; their blocks that fill later are cached again."""
        blocks = self.pool.reset(self.step)
        self.events.emit(ev.RESET, self.step, None, blocks)

    # ----------------------------------------------------------------- queries
    def block_table(self, request_id: int, group: int = 0) -> list[int]:
        return self.seqs[request_id].tables[group]

    def block_tables(self, request_id: int) -> list[list[int]]:
        """The request's table in each group."""
        return self.seqs[request_id].tables

    def blocks_held(self, request_id: int) -> set[int]:
        """Every block the request holds, in any group."""
        return {b for t in self.seqs[request_id].tables for b in t if b != NULL}

    def peak_blocks(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of `num_tokens` tokens may hold at once, computed in
        chunks of at most `max_chunk` tokens: every block in a full-attention group; in a
        sliding-window group those of a chunk and the window before it."""
        bs, every = self.block_size, -(-num_tokens // self.block_size)
        return sum(every if g.window is None else min(every, -(-(max_chunk + g.window) // bs) + 1)
                   for g in self.groups)

    def num_computed_tokens(self, request_id: int) -> int:
        return self.seqs[request_id].num_computed

    def explain_miss(self, request_id: int) -> ex.MissExplanation:
        """Why this request's prompt did not fully hit, as judged when it was admitted."""
        return self.explanations[request_id]

    def counters(self) -> CacheCounters:
        host = self.host
        return CacheCounters(self.hit_tokens, self.query_tokens, self.num_requests_queried,
                             self.num_requests_hit, self.pool.num_evicted, self.num_cow_copies,
                             *(() if host is None else (host.hit_tokens, host.num_offloaded,
                                                        host.num_loaded, host.pool.num_evicted)))

    def group_counts(self) -> tuple[tuple[int, ...], int]:
        """Blocks held by requests in each group now, and blocks released out of a sliding
        window in this step (a StepRecord's group_blocks and window_freed_blocks)."""
        return self.pool.held_by_group(len(self.groups)), self.num_window_freed

    def host_tokens(self, request_id: int) -> int:
        """Of the request's cached prompt tokens, those loaded from the host tier."""
        return self.seqs[request_id].host_tokens

    def num_computed(self) -> dict[int, int]:
        return {r: s.num_computed for r, s in self.seqs.items()}

    def snapshot(self) -> Snapshot:
        return self.pool_state().snapshot()

    def pool_state(self) -> PoolState:
        """A cheap copy of the block state, to be turned into a Snapshot elsewhere."""
        seqs = self.seqs.items()
        return PoolState(self.step, self.block_size, self.pool.copy(),
                         {r: s.tables[0][:] for r, s in seqs}, self.num_computed(),
                         self.counters(), self.groups,
                         tuple({r: s.tables[g][:] for r, s in seqs}
                               for g in range(1, len(self.groups))),
                         None if self.host is None else (self.host.pool.copy(),
                                                         self.host.pool.num_evicted))

    # ----------------------------------------------------------------- helpers
    def _keys(self, cache_salt: str | None, adapter: str | None) -> ExtraKeys:
        # As vLLM: an empty salt is no salt (it hashes a salt only if it is truthy).
        return ExtraKeys(self.model_fingerprint, adapter, cache_salt or None)

    def _chain(self, keys: ExtraKeys, token_ids: list[int]) -> tuple[bytes, list[bytes]]:
        root = self._recent_keys.get(keys) or root_hash(keys)
        if not self.enable_prefix_caching:
            return root, []
        return root, hash_blocks(root, token_ids, self.block_size)

    def _lookup(self, chain: tuple[bytes, list[bytes]], num_tokens: int
                ) -> tuple[int, list[list[int]], tuple[int, ...]]:
        """The longest cached prefix every group accepts, leaving the last token to compute:
        (its length in blocks, each group's hit blocks, NULL for those it does not need, and
        the blocks each group accepted on its first turn, for explanations). As vLLM's
        HybridKVCacheCoordinator: full-attention groups first, then each group may only shrink
        the length, until none does."""
        hashes = chain[1][: (num_tokens - 1) // self.block_size]
        groups = self.groups
        if len(groups) == 1 and groups[0].window is None:
            hit = self._prefix_hit(hashes, 0)
            return len(hit), [hit], (len(hit),)
        n, found, first = len(hashes), [None] * len(groups), [None] * len(groups)
        while True:
            start = n
            for g in self._lookup_order:
                if groups[g].window is None:  # downward-closed: looked up once, then cut
                    if found[g] is None:
                        found[g] = self._prefix_hit(hashes, g)
                else:
                    found[g] = self._window_hit(g, hashes, n)
                n = min(n, len(found[g]))
                if first[g] is None:
                    first[g] = len(found[g])
            if n >= start:
                break
        return n, [f[:n] for f in found], tuple(first)

    def _prefix_hit(self, hashes: list[bytes], g: int) -> list[int]:
        """A full-attention group's hit: its cached blocks from the first, up to a miss (with a
        host tier: its device blocks, then LOAD for each block the host goes on with)."""
        keys = hashes if not g else [group_key(h, g) for h in hashes]
        hit = self.pool.prefix_hit(keys)
        if self.host is not None:
            hit += [LOAD] * len(self.host.pool.prefix_hit(keys[len(hit):]))
        return hit

    def _window_hit(self, g: int, hashes: list[bytes], n: int) -> list[int]:
        """As vLLM's SlidingWindowManager.find_longest_cache_hit within the first n blocks: from
        the right, the first run of the blocks the window needs, NULL before it; without one,
        the run of cached blocks the prompt starts with. With a host tier a run is device
        blocks then LOADs (a host-only block left of a device block starts a new run)."""
        need, h2b = self.groups[g].blocks_for_hit(self.block_size), self.pool.hash_to_block
        on_host = self.host.pool.hash_to_block if self.host is not None else {}
        run: list[int] = []
        device = False  # the run has a device block (no LOAD may come left of it)
        for i in range(n - 1, -1, -1):
            k = group_key(hashes[i], g)
            b = h2b.get(k)
            if b is None:
                if k not in on_host:
                    run, device = [], False
                    continue
                if device:
                    run, device = [], False
                b = LOAD
            else:
                device = True
            run.append(b)
            if len(run) >= need:
                return [NULL] * i + run[::-1]
        return run[::-1]

    def _remember_keys(self, keys: ExtraKeys, root: bytes) -> None:
        self._recent_keys[keys] = root
        self._recent_keys.move_to_end(keys)
        if len(self._recent_keys) > MAX_KEYS_CHECKED:
            self._recent_keys.popitem(last=False)


__all__ = ["KVCacheManager", "NoFreeBlocksError"]
