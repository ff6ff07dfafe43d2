"""Routing what-if: a trace across R replicas, each its own real `KVCacheManager` pool (the same
size, policy and KV-cache groups), under a router; per router the fleet's token hit ratio, each
replica's, the load imbalance (max / mean requests and tokens) and the gap to one pool of R
times the size. Each replica replays what it is sent by whatif's rules (sequential or timed
mode), so one replica is the single-pool lab exactly.

Routers (`parse_routers`, written `round-robin,random,least-loaded,hash:64,prefix-aware`):
- round-robin: request i to replica i mod R.
- random: uniform, one `randrange(R)` per request from `random.Random(seed)`.
- least-loaded: the fewest requests, then the fewest tokens (prompt + output), then the lowest
  index.
- hash:K: consistent hashing of the prompt's first K blocks (the chain key of its K-th block,
  or of its last full block when shorter) on a ring of VNODES points per replica (blake2b).
- prefix-aware: the replica with the longest cached prefix, as each replica's own manager would
  serve it now (device and host tiers: what llm-d's precise prefix-cache scorer reads from KV
  events and Dynamo's KV indexer holds), among the replicas under the load cap; ties go to the
  least loaded, then the lowest index. The cap is consistent hashing with bounded loads'
  (Mirrokni, Thorup, Zadimoghaddam 2018): a replica is a candidate while its requests are fewer
  than ceil(cap x (all requests + 1) / R), so some replica always is.

Load: in timed mode what a replica holds now (requests waiting or running, their prompt and
output tokens). Sequential mode has no time (each request is freed before the next arrives), so
there a replica's load is what it was sent so far.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from bisect import bisect_left
from dataclasses import dataclass

import numpy as np

from kvscope.engine.kv_groups import KVGroup
from kvscope.lab import whatif
from kvscope.lab.traces import Trace

ROUTERS = ("round-robin", "random", "least-loaded", "hash", "prefix-aware")
ROUTER_SYNTAX = "round-robin, random, least-loaded, hash:K (the first K blocks), prefix-aware"
VNODES = 64  # ring points per replica (hash:K)
DEFAULT_LOAD_CAP = 1.25
CURVE_POINTS = 6  # pool sizes per replica replayed for the miss-ratio curve per router


def default_routers(block_size: int) -> list[str]:
    """Every router; hash on the first 1,024 tokens (a conversation's opening)."""
    return ["round-robin", "random", "least-loaded", f"hash:{max(1, 1024 // block_size)}",
            "prefix-aware"]


def parse_routers(text: str) -> list[str]:
    """`round-robin,hash:64` -> ["round-robin", "hash:64"]; ValueError naming the part."""
    routers = []
    for part in (p.strip() for p in text.split(",")):
        name, colon, k = part.partition(":")
        ok = name in ROUTERS and (
            (name == "hash" and k.isdigit() and int(k) > 0) or (name != "hash" and not colon))
        if not ok:
            raise ValueError(f"{part!r} is not a router ({ROUTER_SYNTAX})")
        if part in routers:
            raise ValueError(f"{part!r} is there twice")
        routers.append(part)
    return routers


def ring_hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class HashRing:
    def __init__(self, replicas: int):
        points = sorted((ring_hash(f"replica {r} {v}".encode()), r)
                        for r in range(replicas) for v in range(VNODES))
        self.points = [p for p, _ in points]
        self.owners = [r for _, r in points]

    def owner(self, key: bytes) -> int:
        """The replica of the first ring point at or after the key's hash (wrapping)."""
        i = bisect_left(self.points, ring_hash(key))
        return self.owners[i % len(self.owners)]


def make_router(router: str, replicas: int, seed: int = 0, load_cap: float = DEFAULT_LOAD_CAP):
    """pick(i, request, its block keys, pools, loads [(requests, tokens)]) -> replica."""
    name, _, k = router.partition(":")
    if name == "round-robin":
        return lambda i, r, keys, pools, loads: i % replicas
    if name == "random":
        rng = random.Random(seed)
        return lambda i, r, keys, pools, loads: rng.randrange(replicas)
    if name == "least-loaded":
        return lambda i, r, keys, pools, loads: min(range(replicas), key=loads.__getitem__)
    if name == "hash":
        ring, k = HashRing(replicas), int(k)
        return lambda i, r, keys, pools, loads: ring.owner(keys[min(k, len(keys)) - 1]
                                                           if keys else b"")

    def prefix_aware(i, r, keys, pools, loads):
        cap = math.ceil(load_cap * (sum(n for n, _ in loads) + 1) / replicas)
        n = r.input_length
        return max((j for j in range(replicas) if loads[j][0] < cap),
                   key=lambda j: (pools[j].mgr.cached_tokens(n, keys), -loads[j][0],
                                  -loads[j][1], -j))

    assert name == "prefix-aware", router
    return prefix_aware


@dataclass
class RoutedResult:
    router: str
    replicas: list[whatif.WhatIfResult]  # what each replica was sent (num_requests: its share)
    tokens: list[int]  # prompt and output tokens sent to each replica
    wall_s: float

    @property
    def hit_tokens(self) -> int:
        return sum(r.hit_tokens for r in self.replicas)

    @property
    def query_tokens(self) -> int:
        return sum(r.query_tokens for r in self.replicas)

    @property
    def token_hit_ratio(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def request_hit_ratio(self) -> float:
        n = sum(r.num_requests for r in self.replicas)
        return sum(r.num_requests_hit for r in self.replicas) / n if n else 0.0

    @property
    def request_imbalance(self) -> float:
        return _imbalance([r.num_requests for r in self.replicas])

    @property
    def token_imbalance(self) -> float:
        return _imbalance(self.tokens)


def _imbalance(values: list[int]) -> float:
    """max / mean (1.0: even)."""
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 1.0


def route(trace: Trace, router: str, replicas: int, pool_blocks: int, block_size: int = 16,
          policy: str = "lru", mode: str = "sequential", tpot_s: float = 0.03,
          prefill_s: float = 0.0, hashes: list[list[bytes]] | None = None,
          groups: tuple[KVGroup, ...] | None = None, seed: int = 0,
          load_cap: float = DEFAULT_LOAD_CAP) -> RoutedResult:
    """Replay the trace across `replicas` pools of pool_blocks each under `router`."""
    if mode not in whatif.MODES:
        raise ValueError(f"mode must be one of {', '.join(whatif.MODES)}, got {mode!r}")
    hashes = hashes if hashes is not None else whatif.block_hashes(trace, block_size)
    pools = [whatif.new_pool(mode, whatif.new_manager(trace, pool_blocks, block_size, policy,
                                                      groups, 0, "lru"),
                             trace, hashes, tpot_s, prefill_s) for _ in range(replicas)]
    pick = make_router(router, replicas, seed, load_cap)
    sent = [(0, 0)] * replicas  # requests and tokens sent so far
    timed = mode == "timed"
    start = time.perf_counter()
    for i, r in enumerate(trace.requests):
        if timed:
            for p in pools:
                p.finish_until(r.arrival_s)
        j = pick(i, r, hashes[i], pools, [p.outstanding() for p in pools] if timed else sent)
        sent[j] = (sent[j][0] + 1, sent[j][1] + r.input_length + r.output_length)
        pools[j].arrive(i, r.arrival_s)
    for p in pools:
        p.finish_until(float("inf"))
    wall = time.perf_counter() - start
    return RoutedResult(router, [p.result(wall, policy) for p in pools], [t for _, t in sent],
                        wall)


def curve_sizes(top: int, sizes: list[int], points: int = CURVE_POINTS) -> list[int]:
    """Pool sizes per replica for the miss-ratio curve: log-spaced from 1/64 of `top` (the
    blocks an infinite cache would hold) to all of it, plus `sizes`."""
    grid = np.unique(np.geomspace(max(1, top // 64), max(1, top), points).astype(int))
    return sorted({*grid.tolist(), *sizes})


def verdict(results: list[RoutedResult], one_pool: float) -> str:
    """'prefix-aware: 31.0 % vs round-robin 9.0 %; imbalance 1.30x requests, 1.10x tokens;
    one pool of the fleet's size: 35.0 %' (the best router against round-robin, or the
    first)."""
    best = max(results, key=lambda r: r.token_hit_ratio)
    base = next((r for r in results if r.router == "round-robin"), results[0])
    versus = f" vs {base.router} {100 * base.token_hit_ratio:.1f} %" if base is not best else ""
    return (f"{best.router}: {100 * best.token_hit_ratio:.1f} %{versus}; imbalance "
            f"{best.request_imbalance:.2f}x requests, {best.token_imbalance:.2f}x tokens; one "
            f"pool of the fleet's size: {100 * one_pool:.1f} %")


def run(trace: Trace, routers: list[str], replicas: int, pool_blocks: int,
        one_pool: bool = True, **kw) -> tuple[list[RoutedResult], whatif.WhatIfResult | None]:
    """Every router at one pool size per replica, and (one_pool) the single pool of the fleet's
    size under the same rules. kw: route()'s (block_size, policy, mode, tpot_s, prefill_s,
    hashes, groups, seed, load_cap)."""
    kw["hashes"] = kw.get("hashes") or whatif.block_hashes(trace, kw.get("block_size", 16))
    results = [route(trace, r, replicas, pool_blocks, **kw) for r in routers]
    return results, one_pool_replay(trace, replicas, pool_blocks, **kw) if one_pool else None


def one_pool_replay(trace: Trace, replicas: int, pool_blocks: int, **kw) -> whatif.WhatIfResult:
    """The single pool of the fleet's size (replicas x pool_blocks) under the same rules."""
    single = {k: kw[k] for k in ("block_size", "policy", "mode", "tpot_s", "prefill_s", "hashes",
                                 "groups") if k in kw}
    return whatif.replay(trace, replicas * pool_blocks, **single)


def curve(trace: Trace, routers: list[str], replicas: int, sizes: list[int], **kw
          ) -> dict[str, list[tuple[int, float]]]:
    """The miss-ratio curve per router: (pool blocks per replica, fleet token hit ratio) at each
    size; "one pool" at replicas x each size (plotted at the size per replica)."""
    kw["hashes"] = kw.get("hashes") or whatif.block_hashes(trace, kw.get("block_size", 16))
    points: dict[str, list[tuple[int, float]]] = {r: [] for r in [*routers, "one pool"]}
    for size in sizes:
        results, single = run(trace, routers, replicas, size, **kw)
        for r in results:
            points[r.router].append((size, r.token_hit_ratio))
        points["one pool"].append((size, single.token_hit_ratio))
    return points


CSV_COLUMNS = ("policy", "pool_blocks", "replicas", "router", "replica", "mode",
               "token_hit_ratio", "request_hit_ratio", "requests", "tokens", "evicted_blocks",
               "one_pool_token_hit_ratio")


def csv_rows(r: RoutedResult, one_pool: float) -> list[list]:
    """The fleet's row ("fleet" in the replica column), then one per replica."""
    first = r.replicas[0]
    head = [first.policy, first.pool_blocks, len(r.replicas), r.router]
    rows = [[*head, "fleet", first.mode, f"{r.token_hit_ratio:.6f}",
             f"{r.request_hit_ratio:.6f}", sum(x.num_requests for x in r.replicas),
             sum(r.tokens), sum(x.evicted_blocks for x in r.replicas), f"{one_pool:.6f}"]]
    rows += [[*head, j, x.mode, f"{x.token_hit_ratio:.6f}", f"{x.request_hit_ratio:.6f}",
              x.num_requests, tokens, x.evicted_blocks, ""]
             for j, (x, tokens) in enumerate(zip(r.replicas, r.tokens, strict=True))]
    return rows
