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


def replay(trace: Trace, pool_blocks: int, block_size: int = 16, policy: str = "lru",
           mode: str = "sequential", tpot_s: float = 0.03,
           hashes: list[list[bytes]] | None = None, on_request=None,
           groups: tuple[KVGroup, ...] | None = None, host_blocks: int = 0,
           host_policy: str = "lru") -> WhatIfResult:
    """Replay the trace; `hashes` from block_hashes() may be shared between runs.
    on_request(manager, i): called after request i is admitted (for observers). groups: the
    KV-cache groups (None: the trace's). host_blocks: a host tier of that many blocks (0:
    none), evicting by host_policy."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    hashes = hashes if hashes is not None else block_hashes(trace, block_size)
    groups = trace.groups if groups is None else groups
    mgr = KVCacheManager(pool_blocks, block_size, record_events=on_request is not None,
                         eviction_policy=policy, groups=groups, host_blocks=host_blocks,
                         host_eviction_policy=host_policy)
    mgr.pool.evicted_history = 0  # the lab explains no misses: skip the eviction history
    if mgr.host is not None:
        mgr.host.pool.evicted_history = 0
    run = _sequential if mode == "sequential" else _timed
    start = time.perf_counter()
    stats = run(mgr, trace, hashes, tpot_s, on_request)
    wall = time.perf_counter() - start
    hit, host_hit, query, requests, requests_hit, rejected, blocks = stats
    c = mgr.counters()
    return WhatIfResult(policy, pool_blocks, block_size, mode, hit, query, requests,
                        requests_hit, rejected, c.num_evicted_blocks, blocks, wall, mgr.groups,
                        host_blocks, host_policy, host_hit, c.num_offloaded_blocks,
                        c.num_loaded_blocks, c.num_host_evicted_blocks)


def _sequential(mgr, trace, hashes, tpot_s, on_request):
    hit_tokens = host_tokens = query_tokens = requests_hit = rejected = blocks = 0
    zeros = [0] * max(r.input_length for r in trace.requests)
    num_groups = len(mgr.groups)
    for i, r in enumerate(trace.requests):
        n = r.input_length
        query_tokens += n
        if n == 0:
            continue
        mgr.begin_step(i)
        # the pool holds nothing but the cache now: a request it cannot take never fits
        cached = mgr.admit(i, zeros[:n], count_stats=False, block_hashes=hashes[i])
        if cached is None:
            rejected += 1
            continue
        if on_request is not None:
            on_request(mgr, i)
        host_tokens += mgr.host_tokens(i)
        mgr.free(i)
        hit_tokens += cached
        requests_hit += cached > 0
        blocks += len(hashes[i]) + num_groups * -(-(n - cached) // mgr.block_size)
    return (hit_tokens, host_tokens, query_tokens, len(trace.requests), requests_hit, rejected,
            blocks)


def _timed(mgr, trace, hashes, tpot_s, on_request):
    requests = trace.requests
    finishing: list[tuple[float, int]] = []  # (finish time, request index)
    waiting: deque[int] = deque()
    hit_tokens = host_tokens = query_tokens = requests_hit = rejected = blocks = 0
    steps = iter(range(1 << 62))  # each admission is a step (host blocks loaded: held in it)

    def try_admit(i: int, now: float) -> bool:
        nonlocal hit_tokens, host_tokens, requests_hit, blocks
        r = requests[i]
        mgr.begin_step(next(steps))
        cached = mgr.admit(i, [0] * r.input_length, count_stats=False, block_hashes=hashes[i])
        if cached is None:
            return False
        mgr.append_token_ids(i, [0] * r.output_length)
        if not mgr.can_allocate(i, r.output_length):
            mgr.free(i)  # cannot hold its answer yet: wait
            return False
        mgr.allocate(i, r.output_length)
        if on_request is not None:
            on_request(mgr, i)
        hit_tokens += cached
        host_tokens += mgr.host_tokens(i)
        requests_hit += cached > 0
        blocks += len(hashes[i]) + sum(map(len, mgr.block_tables(i)))
        heapq.heappush(finishing, (now + r.output_length * tpot_s, i))
        return True

    def finish_until(t: float) -> None:
        while finishing and finishing[0][0] <= t:
            done, i = heapq.heappop(finishing)
            mgr.free(i)
            while waiting and try_admit(waiting[0], done):
                waiting.popleft()

    for i, r in enumerate(requests):
        finish_until(r.arrival_s)
        query_tokens += r.input_length
        if r.input_length == 0 or _peak_blocks(mgr, r) > mgr.pool.num_blocks:
            rejected += r.input_length > 0
            continue
        if waiting or not try_admit(i, r.arrival_s):
            waiting.append(i)
    finish_until(float("inf"))
    assert not waiting, "requests left waiting with an empty pool"
    return hit_tokens, host_tokens, query_tokens, len(requests), requests_hit, rejected, blocks


def _peak_blocks(mgr: KVCacheManager, r) -> int:
    """Timed mode: the most blocks request r holds, on an empty pool and without a hit (a hit
    needs no more): its prompt in every group, then its output, after each sliding window let
    go of the prompt's blocks before it."""
    bs = mgr.block_size
    prompt, total = -(-r.input_length // bs), -(-(r.input_length + r.output_length) // bs)
    return max(len(mgr.groups) * prompt,
               sum(total - g.skipped_tokens(r.input_length) // bs for g in mgr.groups))
