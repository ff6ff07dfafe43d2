"""A TTL prompt cache written the plain way, independent of kvscope's lab and manager, for the
billing tests: a block is identified by the trace's hash ids up to it; a request may cache its
full blocks before its last token; it reads the leading ones still alive (last used at most
`ttl_s` before it arrives), writes the rest, and all of them are last used when it ends (its
arrival in sequential mode; arrival + output x tpot in timed mode, while it holds them)."""

from __future__ import annotations

import json
from pathlib import Path


def plain_ttl(path: Path, ttl_s: float, limit: int, block_size: int = 16, timed: bool = False,
              tpot_s: float = 0.03, trace_block: int = 512) -> tuple[int, int, int]:
    """(read tokens, written tokens, requests that read something) of the first `limit`
    requests."""
    last_use: dict = {}  # block -> when the last request using it ends (ms -> s)
    read = written = requests_read = 0
    with open(path) as f:
        lines = [json.loads(line) for _, line in zip(range(limit), f, strict=False)]
    for r in lines:
        n, ids, now = r["input_length"], r["hash_ids"], r["timestamp"] / 1000
        keys = [(tuple(ids[: k * block_size // trace_block + 1]), k * block_size % trace_block)
                for k in range((n - 1) // block_size)]
        hit = 0
        while hit < len(keys) and keys[hit] in last_use and now - last_use[keys[hit]] <= ttl_s:
            hit += 1
        read += hit * block_size
        written += (len(keys) - hit) * block_size
        requests_read += hit > 0
        end = now + (r["output_length"] * tpot_s if timed else 0)
        for k in keys:
            last_use[k] = max(last_use.get(k, end), end)
    return read, written, requests_read
