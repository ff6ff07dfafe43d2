"""Replay a production request trace through the cache manager, with no model.

Mooncake traces (FAST'25) give, per request, an arrival time, prompt and output lengths and the
prompt's block hash ids at 512 tokens per block. Each hash id becomes a fixed run of 512 token ids
derived from the id, so requests share token prefixes exactly where their hash ids agree, at any
block size that divides 512. A request is admitted on arrival (FCFS, waiting while the pool is
full), holds its prompt and output blocks for `output_length * tpot_s` seconds, then is freed.
"""

from __future__ import annotations

import heapq
import json
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from kvscope.engine.kv_cache_manager import KVCacheManager

TRACE_BLOCK = 512
OUTPUT_TOKEN_BASE = 1 << 40  # generated tokens: unique per request, never equal to prompt tokens


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def prompt_token_ids(self) -> list[int]:
        tokens: list[int] = []
        for h in self.hash_ids:
            tokens.extend(range(h * TRACE_BLOCK, (h + 1) * TRACE_BLOCK))
        return tokens[: self.input_length]


def load_mooncake(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    requests = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(requests) >= limit:
                break
            r = json.loads(line)
            requests.append(TraceRequest(r["timestamp"] / 1000, r["input_length"],
                                         r["output_length"], tuple(r["hash_ids"])))
    return requests


@dataclass
class ReplayResult:
    num_requests: int
    num_rejected: int  # larger than the whole pool
    hit_tokens: int
    query_tokens: int
    num_evicted_blocks: int
    num_operations: int  # admit + allocate + free calls

    @property
    def token_hit_ratio(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def replay(mgr: KVCacheManager, requests: list[TraceRequest], tpot_s: float = 0.03
           ) -> ReplayResult:
    finishing: list[tuple[float, int]] = []  # (finish time, request index)
    waiting: deque[int] = deque()
    ops = rejected = hit_tokens = query_tokens = 0
    pool_tokens = mgr.pool.num_blocks * mgr.block_size

    def try_admit(i: int, now: float) -> bool:
        nonlocal ops, hit_tokens, query_tokens
        r = requests[i]
        prompt = r.prompt_token_ids()
        cached = mgr.admit(i, prompt, count_stats=False)  # retried while waiting: count below
        if cached is None:
            return False
        output = range(OUTPUT_TOKEN_BASE + i * 1_000_000,
                       OUTPUT_TOKEN_BASE + i * 1_000_000 + r.output_length)
        mgr.append_token_ids(i, list(output))
        if not mgr.can_allocate(i, r.output_length):
            mgr.free(i)  # cannot hold its answer yet: wait
            ops += 2
            return False
        mgr.allocate(i, r.output_length)
        hit_tokens += cached
        query_tokens += len(prompt)
        heapq.heappush(finishing, (now + r.output_length * tpot_s, i))
        ops += 2
        return True

    def finish_until(t: float) -> None:
        nonlocal ops
        while finishing and finishing[0][0] <= t:
            done, i = heapq.heappop(finishing)
            mgr.free(i)
            ops += 1
            while waiting and try_admit(waiting[0], done):
                waiting.popleft()

    for i, r in enumerate(requests):
        finish_until(r.arrival_s)
        if r.input_length + r.output_length > pool_tokens:
            rejected += 1
            continue
        if waiting or not try_admit(i, r.arrival_s):
            waiting.append(i)
    finish_until(float("inf"))
    assert not waiting, "requests left waiting with an empty pool"
    return ReplayResult(len(requests), rejected, hit_tokens, query_tokens, mgr.pool.num_evicted,
                        ops)
