"""What-if replay: a trace through the real `KVCacheManager` (no model), one pool size and one
eviction policy per run.

Modes:
- ``sequential``: each request is admitted (its prompt only), then freed, in trace order; the
  pool holds nothing but the cache between requests. Output tokens are not simulated. This is
  the pure cache question: which prompt blocks would have been hits.
- ``timed``: requests arrive at their trace timestamps, are admitted first come first served
  (waiting while the pool cannot hold prompt and output), hold their prompt and output blocks
  for ``output_length x tpot_s`` seconds, then are freed. Output blocks are cached like any full
  block (as vLLM does) but never hit, since the trace's next prompts carry their own ids.

Both count prompt tokens only: a request's hit tokens are the cached prefix the manager served
(whole blocks, leaving the last prompt token to compute). A request larger than the whole pool
is rejected and counted as a miss. The trace's block ids are the chain hashes (no token hashing:
the hash-id fast path).

KV-cache groups (`groups`, by default the trace's: one full-attention group, or a recorded
session's own): every group of a request draws from the one pool and a hit is the length every
group accepts, as the engine and vLLM's hybrid coordinator do. On the command line they are
written `full,window:1024` (see parse_groups).

A host tier (`host_blocks`, `host_policy`: engine.host_tier): the manager's own, behind the
pool, for every KV-cache group (a window group loads only the blocks its window needs). A
device block evicted is copied to the host; a lookup that stops on the device goes on there
and loads what it finds back (the host copy stays). Each request is a step (`begin_step`), so
host blocks loaded for one request are held through it and free again at the next. The result
then splits the hit tokens by tier and counts the blocks offloaded, loaded and evicted from the
host.

A timed policy (ttl, with `ttl_s`): the pool's clock is the trace's. Each arrival moves it (and
in timed mode each finish, before the request's blocks are released, so a block's last use is
the end of the last request holding it): a cached block expires once ttl_s seconds have passed
since its last use. In sequential mode a request is freed as it arrives, so a block's last use
is the arrival of the last request that used it, as an API's prompt cache counts it.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass

from kvscope.engine.kv_cache_manager import KVCacheManager
from kvscope.engine.kv_groups import ONE_GROUP, KVGroup
from kvscope.lab.traces import Trace

MODES = ("sequential", "timed")
GROUPS_SYNTAX = "full and window:W (tokens), comma-separated, e.g. full,window:1024"


def parse_groups(text: str) -> tuple[KVGroup, ...]:
    """`full,window:1024` -> (KVGroup(), KVGroup(window=1024)); ValueError naming the part."""
    groups = []
    for part in text.split(","):
        kind, _, size = part.strip().partition(":")
        if kind == "full" and not size:
            group = KVGroup()
        elif kind == "window" and size.strip().isdigit() and int(size) > 0:
            group = KVGroup(window=int(size))
        else:
            raise ValueError(f"KV-cache groups {text!r}: {part.strip()!r} is not a group "
                             f"({GROUPS_SYNTAX})")
        if group in groups:
            raise ValueError(f"KV-cache groups {text!r}: {part.strip()!r} is there twice")
        groups.append(group)
    return tuple(groups)


def groups_spec(groups: tuple[KVGroup, ...]) -> str:
    """parse_groups' inverse: "full,window:1024"."""
    return ",".join("full" if g.window is None else f"window:{g.window}" for g in groups)


@dataclass
class WhatIfResult:
    policy: str
    pool_blocks: int
    block_size: int
    mode: str
    hit_tokens: int
    query_tokens: int
    num_requests: int
    num_requests_hit: int
    num_rejected: int  # larger than the whole pool
    evicted_blocks: int
    num_blocks_processed: int  # prompt blocks looked up plus blocks allocated
    wall_s: float
    groups: tuple[KVGroup, ...] = ONE_GROUP
    host_blocks: int = 0  # 0: no host tier
    host_policy: str = "lru"
    host_hit_tokens: int = 0  # of hit_tokens, those loaded from the host tier
    offloaded_blocks: int = 0  # device blocks copied to the host when evicted
    loaded_blocks: int = 0  # host blocks copied back to the device
    host_evicted_blocks: int = 0
    ttl_s: float | None = None  # the ttl policy's lifetime (None: none)
    expired_blocks: int = 0  # cached blocks a TTL dropped (not in evicted_blocks)

    @property
    def device_hit_tokens(self) -> int:
        return self.hit_tokens - self.host_hit_tokens

    @property
    def host_hit_ratio(self) -> float:
        return self.host_hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def device_hit_ratio(self) -> float:
        return self.token_hit_ratio - self.host_hit_ratio

    @property
    def token_hit_ratio(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def request_hit_ratio(self) -> float:
        return self.num_requests_hit / self.num_requests if self.num_requests else 0.0


def block_hashes(trace: Trace, block_size: int) -> list[list[bytes]]:
    """Each request's chain hashes, 8 bytes per block (the manager's dict keys)."""
    trace.check_block_size(block_size)
    return [[k.to_bytes(8, "little") for k in trace.block_keys(r, block_size)]
            for r in trace.requests]


def new_manager(trace: Trace, pool_blocks: int, block_size: int, policy: str,
                groups: tuple[KVGroup, ...] | None, host_blocks: int, host_policy: str,
                record_events: bool = False, ttl_s: float | None = None) -> KVCacheManager:
    """A what-if pool: the real manager, without the eviction history (the lab explains no
    misses)."""
    mgr = KVCacheManager(pool_blocks, block_size, record_events=record_events,
                         eviction_policy=policy, groups=trace.groups if groups is None else groups,
                         host_blocks=host_blocks, host_eviction_policy=host_policy,
                         ttl_s=ttl_s)
    mgr.pool.evicted_history = 0
    if mgr.host is not None:
        mgr.host.pool.evicted_history = 0
    return mgr


def replay(trace: Trace, pool_blocks: int, block_size: int = 16, policy: str = "lru",
           mode: str = "sequential", tpot_s: float = 0.03,
           hashes: list[list[bytes]] | None = None, on_request=None,
           groups: tuple[KVGroup, ...] | None = None, host_blocks: int = 0,
           host_policy: str = "lru", prefill_s: float = 0.0,
           ttl_s: float | None = None) -> WhatIfResult:
    """Replay the trace; `hashes` from block_hashes() may be shared between runs.
    on_request(manager, i): called after request i is admitted (for observers). groups: the
    KV-cache groups (None: the trace's). host_blocks: a host tier of that many blocks (0:
    none), evicting by host_policy. prefill_s: timed mode, seconds per prompt token computed
    (not served from the cache), added to the time a request holds its blocks. ttl_s: the
    ttl policy's lifetime of a cached block after its last use."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    hashes = hashes if hashes is not None else block_hashes(trace, block_size)
    mgr = new_manager(trace, pool_blocks, block_size, policy, groups, host_blocks, host_policy,
                      on_request is not None, ttl_s)
    pool = new_pool(mode, mgr, trace, hashes, tpot_s, prefill_s, on_request)
    start = time.perf_counter()
    for i, r in enumerate(trace.requests):
        pool.arrive(i, r.arrival_s)
    pool.finish_until(float("inf"))
    return pool.result(time.perf_counter() - start, policy, host_policy)


def new_pool(mode: str, mgr: KVCacheManager, trace: Trace, hashes: list[list[bytes]],
             tpot_s: float = 0.03, prefill_s: float = 0.0, on_request=None) -> SequentialPool:
    """A replay of one pool that requests arrive at (`arrive(i, now)`), in the mode's rules."""
    if mode == "sequential":
        return SequentialPool(mgr, trace, hashes, on_request)
    return TimedPool(mgr, trace, hashes, on_request, tpot_s, prefill_s)


class SequentialPool:
    """Sequential mode: a request is admitted (its prompt only) and freed as it arrives."""

    def __init__(self, mgr: KVCacheManager, trace: Trace, hashes: list[list[bytes]],
                 on_request=None):
        self.mgr, self.trace, self.hashes, self.on_request = mgr, trace, hashes, on_request
        self.hit_tokens = self.host_tokens = self.query_tokens = 0
        self.num_requests = self.requests_hit = self.rejected = self.blocks = 0
        self.on_count = None  # on_count(i, hit tokens): each request admitted (lab.billing)

    def arrive(self, i: int, now: float) -> None:
        mgr, n = self.mgr, self.trace.requests[i].input_length
        self.num_requests += 1
        self.query_tokens += n
        if n == 0:
            return
        mgr.begin_step(i)
        mgr.advance_clock(now)
        # the pool holds nothing but the cache now: a request it cannot take never fits
        cached = mgr.admit(i, [0] * n, count_stats=False, block_hashes=self.hashes[i])
        if cached is None:
            self.rejected += 1
            return
        if self.on_request is not None:
            self.on_request(mgr, i)
        self.host_tokens += mgr.host_tokens(i)
        mgr.free(i)
        self._count(i, cached, len(mgr.groups) * -(-(n - cached) // mgr.block_size))

    def _count(self, i: int, cached: int, allocated: int) -> None:
        self.hit_tokens += cached
        self.requests_hit += cached > 0
        if self.on_count is not None:
            self.on_count(i, cached)
        self.blocks += len(self.hashes[i]) + allocated

    def finish_until(self, t: float) -> None:
        """Timed mode's: nothing is held between requests here."""

    def outstanding(self) -> tuple[int, int]:
        """(requests, prompt and output tokens) waiting or running: none here."""
        return 0, 0

    def result(self, wall_s: float, policy: str, host_policy: str = "lru") -> WhatIfResult:
        mgr = self.mgr
        c = mgr.counters()
        return WhatIfResult(
            policy, mgr.pool.num_blocks, mgr.block_size,
            "sequential" if type(self) is SequentialPool else "timed", self.hit_tokens,
            self.query_tokens, self.num_requests, self.requests_hit, self.rejected,
            c.num_evicted_blocks, self.blocks, wall_s, mgr.groups,
            mgr.host.pool.num_blocks if mgr.host else 0, host_policy, self.host_tokens,
            c.num_offloaded_blocks, c.num_loaded_blocks, c.num_host_evicted_blocks,
            mgr.pool.ttl_s, mgr.pool.num_expired)


class TimedPool(SequentialPool):
    """Timed mode: requests are admitted first come first served (waiting while the pool cannot
    hold prompt and output) and hold their blocks until they finish."""

    def __init__(self, mgr, trace, hashes, on_request=None, tpot_s: float = 0.03,
                 prefill_s: float = 0.0):
        super().__init__(mgr, trace, hashes, on_request)
        self.tpot_s, self.prefill_s = tpot_s, prefill_s
        self.finishing: list[tuple[float, int]] = []  # (finish time, request index)
        self.waiting: deque[int] = deque()
        self.steps = iter(range(1 << 62))  # each admission is a step (host loads: held in it)
        self.held_tokens = 0  # prompt and output tokens of the requests waiting or running

    def arrive(self, i: int, now: float) -> None:
        r = self.trace.requests[i]
        self.finish_until(now)
        self.num_requests += 1
        self.query_tokens += r.input_length
        if r.input_length == 0 or _peak_blocks(self.mgr, r) > self.mgr.pool.num_blocks:
            self.rejected += r.input_length > 0
            return
        self.held_tokens += r.input_length + r.output_length
        if self.waiting or not self._try_admit(i, now):
            self.waiting.append(i)

    def _try_admit(self, i: int, now: float) -> bool:
        mgr, r = self.mgr, self.trace.requests[i]
        mgr.begin_step(next(self.steps))
        mgr.advance_clock(now)
        cached = mgr.admit(i, [0] * r.input_length, count_stats=False,
                           block_hashes=self.hashes[i])
        if cached is None:
            return False
        mgr.append_token_ids(i, [0] * r.output_length)
        if not mgr.can_allocate(i, r.output_length):
            mgr.free(i)  # cannot hold its answer yet: wait
            return False
        mgr.allocate(i, r.output_length)
        if self.on_request is not None:
            self.on_request(mgr, i)
        self.host_tokens += mgr.host_tokens(i)
        self._count(i, cached, sum(map(len, mgr.block_tables(i))))
        hold = (r.input_length - cached) * self.prefill_s + r.output_length * self.tpot_s
        heapq.heappush(self.finishing, (now + hold, i))
        return True

    def finish_until(self, t: float) -> None:
        while self.finishing and self.finishing[0][0] <= t:
            done, i = heapq.heappop(self.finishing)
            self.mgr.advance_clock(done)
            self.mgr.free(i)
            r = self.trace.requests[i]
            self.held_tokens -= r.input_length + r.output_length
            while self.waiting and self._try_admit(self.waiting[0], done):
                self.waiting.popleft()
        if t == float("inf"):
            assert not self.waiting, "requests left waiting with an empty pool"

    def outstanding(self) -> tuple[int, int]:
        return len(self.waiting) + len(self.finishing), self.held_tokens


def _peak_blocks(mgr: KVCacheManager, r) -> int:
    """Timed mode: the most blocks request r holds, on an empty pool and without a hit (a hit
    needs no more): its prompt in every group, then its output, after each sliding window let
    go of the prompt's blocks before it."""
    bs = mgr.block_size
    prompt, total = -(-r.input_length // bs), -(-(r.input_length + r.output_length) // bs)
    return max(len(mgr.groups) * prompt,
               sum(total - g.skipped_tokens(r.input_length) // bs for g in mgr.groups))
