"""An LRU prefix cache written the plain way, independent of kvscope's lab and manager, for the
lab's tests and benchmarks/lab_replay.py: prompts only, full blocks only, a block identified by
the trace's hash ids up to it; a hit needs every earlier block hit and leaves the last prompt
token to compute; a prompt larger than the pool is a miss and changes nothing. After a request
its blocks are the most recent, head last (the manager releases tail first)."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path


def plain_lru_hit_ratio(path: Path, pool_blocks: int, block_size: int = 16,
                        trace_block: int = 512) -> float:
    cache: OrderedDict = OrderedDict()
    hit = query = 0
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            n, ids = r["input_length"], r["hash_ids"]
            query += n
            if -(-n // block_size) > pool_blocks:
                continue
            keys = [(tuple(ids[: k * block_size // trace_block + 1]),
                     k * block_size % trace_block) for k in range(n // block_size)]
            for k in keys[: (n - 1) // block_size]:
                if k not in cache:
                    break
                hit += block_size
            for k in reversed(keys):
                cache[k] = None
                cache.move_to_end(k)
            while len(cache) > pool_blocks:
                cache.popitem(last=False)
    return hit / query
