"""Routing across replicas written the plain way, independent of kvscope's lab and manager, for
the routing lab's tests and benchmarks/lab_routing.py: one plain LRU prefix cache per replica (as
plain_lru.py: prompts only, full blocks only, a block identified by the trace's hash ids up to it
and its place in the trace block; a hit leaves the last prompt token to compute; a prompt larger
than the pool is a miss and changes nothing), sequential mode, and the routers as the lab
documents them (kvscope.lab.routing), from the raw JSON lines:
- round-robin i mod R; random: one randrange(R) per request from random.Random(seed);
- least-loaded: fewest requests sent, then fewest prompt + output tokens, then lowest index;
- hash:K: the key of the K-th block (or the last full one) is node * 1024 + j, node numbering
  the distinct id prefixes in order of first appearance and j the block's place in its trace
  block; its 8 little-endian bytes' blake2b (8 bytes) looked up on a ring of 64 points per
  replica, blake2b of "replica r v";
- prefix-aware: the longest run of cached leading blocks among replicas sent fewer than
  ceil(cap x (all sent + 1) / R) requests; ties: fewer requests, fewer tokens, lower index."""

from __future__ import annotations

import hashlib
import json
import math
import random
from bisect import bisect_left
from collections import OrderedDict
from pathlib import Path


def _h(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def plain_routed_hit_ratio(path: Path, router: str, replicas: int, pool_blocks: int,
                           limit: int | None = None, block_size: int = 16,
                           trace_block: int = 512, seed: int = 0, load_cap: float = 1.25
                           ) -> tuple[float, list[int]]:
    """(fleet token hit ratio, requests sent to each replica)."""
    caches = [OrderedDict() for _ in range(replicas)]
    sent = [[0, 0] for _ in range(replicas)]
    ring = sorted((_h(f"replica {r} {v}".encode()), r) for r in range(replicas)
                  for v in range(64))
    rng = random.Random(seed)
    node_of: dict[tuple, int] = {}
    per = trace_block // block_size
    hit = query = 0
    with open(path) as f:
        lines = [json.loads(line) for line in f][:limit]
    for i, r in enumerate(lines):
        n, ids = r["input_length"], r["hash_ids"]
        for k in range(len(ids)):
            node_of.setdefault(tuple(ids[: k + 1]), len(node_of))
        keys = [(tuple(ids[: k // per + 1]), k % per) for k in range(n // block_size)]
        hittable = keys[: (n - 1) // block_size]

        def cached(c, hittable=hittable):
            m = 0
            while m < len(hittable) and hittable[m] in c:
                m += 1
            return m

        name, _, k = router.partition(":")
        if name == "round-robin":
            j = i % replicas
        elif name == "random":
            j = rng.randrange(replicas)
        elif name == "least-loaded":
            j = min(range(replicas), key=lambda x: (*sent[x], x))
        elif name == "hash":
            if keys:
                prefix, place = keys[min(int(k), len(keys)) - 1]
                key = (node_of[prefix] * 1024 + place).to_bytes(8, "little")
            else:
                key = b""
            pos = bisect_left([p for p, _ in ring], _h(key))
            j = ring[pos % len(ring)][1]
        else:
            cap = math.ceil(load_cap * (sum(s[0] for s in sent) + 1) / replicas)
            j = max((x for x in range(replicas) if sent[x][0] < cap),
                    key=lambda x: (cached(caches[x]), -sent[x][0], -sent[x][1], -x))
        sent[j][0] += 1
        sent[j][1] += n + r["output_length"]
        query += n
        cache = caches[j]
        if -(-n // block_size) > pool_blocks:
            continue
        hit += cached(cache) * block_size
        for key in reversed(keys):
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > pool_blocks:
            cache.popitem(last=False)
    return hit / query, [s[0] for s in sent]
