"""Hit ratios at every pool size without a replay per size: the LRU miss-ratio curve in one
pass (stack distances), Belady's optimum (the ceiling for any policy at a size) and the
infinite cache (the ceiling at any size). Sequential mode, prompts only, as `whatif`.

All three work on *segments*: the runs of kvscope blocks of one trace block that requests always
reference together (a trace block is cut where some request's prompt ends inside it). A segment
of w blocks stands for w unit blocks in a fixed order, which keeps every count exact at a
fraction of the work: the whole Mooncake conversation trace is ~9M block references at block
size 16 but only ~0.3M segment references.

A block counts as a hit only if every block before it in the prompt hit too (a prefix cache),
and a prompt's last token is always computed (as the manager does).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from kvscope.lab.traces import Trace


@dataclass
class SegmentStream:
    """requests[i] = [(segment, units, hittable units), ...] in prompt order; a segment's
    units are all hittable or none (segments are also cut where the hittable blocks end)."""

    requests: list[list[tuple[int, int, int]]]
    needed: list[int]  # blocks each request holds while admitted: it fits pools at least this big
    block_size: int
    query_tokens: int
    num_segments: int


def segment_stream(trace: Trace, block_size: int) -> SegmentStream:
    trace.check_block_size(block_size)
    k = trace.trace_block // block_size
    cuts: dict[int, set[int]] = {}
    for r in trace.requests:  # cut where a prompt ends and where its hittable blocks end
        for end in (r.input_length // block_size, max(0, (r.input_length - 1) // block_size)):
            q, p = divmod(end, k)
            if p:
                cuts.setdefault(r.nodes[q], set()).add(p)
    bounds = {node: [0, *sorted(c), k] for node, c in cuts.items()}
    seg_id: dict[tuple[int, int], int] = {}
    out = []
    for r in trace.requests:
        m = r.input_length // block_size
        hittable = max(0, (r.input_length - 1) // block_size)
        refs = []
        for i in range(-(-m // k)):
            node, base = r.nodes[i], i * k
            b = bounds.get(node, (0, k))
            end = min(k, m - base)
            for lo, hi in zip(b, b[1:], strict=False):
                if lo >= end:
                    break
                s = seg_id.setdefault((node, lo), len(seg_id))
                refs.append((s, hi - lo, min(hi - lo, max(0, hittable - base - lo))))
        out.append(refs)
    needed = [-(-r.input_length // block_size) for r in trace.requests]
    return SegmentStream(out, needed, block_size, sum(r.input_length for r in trace.requests),
                         len(seg_id))


def distinct_blocks(stream: SegmentStream) -> int:
    units: dict[int, int] = {}
    for refs in stream.requests:
        for s, w, _ in refs:
            units[s] = w
    return sum(units.values())


@dataclass
class Ceiling:
    hit_tokens: int
    requests_hit: int  # requests with at least one block served from the cache
    evicted_blocks: int


def infinite_cache(stream: SegmentStream) -> Ceiling:
    seen: set[int] = set()
    hits = requests_hit = 0
    for refs in stream.requests:
        prefix, before = True, hits
        for s, _, h in refs:
            prefix = prefix and s in seen
            hits += h if prefix else 0
        requests_hit += hits > before
        seen.update(s for s, _, _ in refs)
    return Ceiling(hits * stream.block_size, requests_hit, 0)


def lru_hit_tokens(stream: SegmentStream, pool_sizes: list[int]) -> list[int]:
    """Hit tokens of an LRU prefix cache of each size, from one pass of stack distances. A
    request looks up its prompt, then its blocks go to the top of the stack head first (the
    manager releases them tail first), so depth d (0 = top) hits at sizes > d. Requests larger
    than a pool are rejected there (no hits), but their blocks still enter the stack: a small
    overestimate at sizes that reject requests."""
    n_slots = sum(len(refs) for refs in stream.requests) + 1
    tree = [0] * (n_slots + 1)  # Fenwick tree over access times: the weight of the last access
    last: dict[int, int] = {}
    total = 0  # weight of all live slots
    points: dict[int, int] = {}  # threshold -> hit blocks needing at least that size
    lo_list, hi_list = [], []  # ranges of thresholds, one hit block each
    now = 0
    for refs, needed in zip(stream.requests, stream.needed, strict=True):
        # Depth so far among this prompt's hittable blocks, and a request larger than the pool
        # is rejected: it hits only at sizes >= needed.
        prefix_max = needed - 1
        missed = False
        for s, _, h in refs:
            if missed or h == 0:
                continue
            t = last.get(s)
            if t is None:
                missed = True
                continue
            above, i = total, t  # weight of slots after t: total - prefix(t)
            while i > 0:
                above -= tree[i]
                i -= i & -i
            # depths above..above+h-1; thresholds max(prefix_max, depth) + 1
            flat = min(h, max(0, prefix_max - above + 1))
            if flat:
                points[prefix_max + 1] = points.get(prefix_max + 1, 0) + flat
            if flat < h:
                lo_list.append(above + flat + 1)
                hi_list.append(above + h)
            prefix_max = max(prefix_max, above + h - 1)
        for s, w, _ in reversed(refs):  # tail first, so the head ends on top
            t = last.get(s)
            if t is not None:
                i = t
                while i < len(tree):
                    tree[i] -= w
                    i += i & -i
                total -= w
            now += 1
            last[s] = now
            i = now
            while i < len(tree):
                tree[i] += w
                i += i & -i
            total += w
    thresholds = np.array(sorted(points), dtype=np.int64)
    counts = np.cumsum([points[t] for t in sorted(points)], dtype=np.int64)
    lo, hi = np.array(lo_list, dtype=np.int64), np.array(hi_list, dtype=np.int64)
    out = []
    for size in pool_sizes:
        k = np.searchsorted(thresholds, size, side="right")
        hits = int(counts[k - 1]) if k else 0
        hits += int(np.clip(np.minimum(hi, size) - lo + 1, 0, None).sum())
        out.append(hits * stream.block_size)
    return out


def belady(stream: SegmentStream, pool_blocks: int) -> Ceiling:
    """Belady's MIN: every reference may load its blocks; on overflow, drop the blocks whose
    next *counting* use is farthest (possibly the ones just loaded). A use counts where a hit
    would: a hittable block of a request that fits the pool. A child's next counting use is
    always after its parent's (a prompt that can hit the child can hit the parent before it),
    so the cache stays prefix-closed and MIN's block hits are prefix hits: no policy of this
    pool size can beat it (checked against brute force in the tests)."""
    order = [(s, h == w and needed <= pool_blocks)
             for refs, needed in zip(stream.requests, stream.needed, strict=True)
             for s, w, h in refs]
    never = len(order)
    following = [never] * len(order)  # index of the next counting reference to the segment
    seen: dict[int, int] = {}
    for i in range(len(order) - 1, -1, -1):
        s, counts = order[i]
        following[i] = seen.get(s, never)
        if counts:
            seen[s] = i
    resident: dict[int, int] = {}  # segment -> units held (always its leading units)
    next_use: dict[int, int] = {}
    heap: list[tuple[int, int]] = []  # (-next use, segment), stale entries skipped
    held = hits = requests_hit = evicted = 0
    i = 0
    for refs, needed in zip(stream.requests, stream.needed, strict=True):
        prefix, before = needed <= pool_blocks, hits  # a request larger than the pool: no hit
        for s, w, h in refs:
            have = resident.get(s, 0)
            if prefix:
                got = min(have, h)
                hits += got
                prefix = got == h and have >= min(w, h)
            held += w - have
            resident[s] = w
            next_use[s] = following[i]
            heapq.heappush(heap, (-following[i], s))
            i += 1
            while held > pool_blocks:
                neg, v = heapq.heappop(heap)
                if next_use.get(v) != -neg or v not in resident:
                    continue
                drop = min(resident[v], held - pool_blocks)  # from the segment's tail
                resident[v] -= drop
                held -= drop
                evicted += drop
                if resident[v]:
                    heapq.heappush(heap, (neg, v))
                else:
                    del resident[v]
        requests_hit += hits > before
    return Ceiling(hits * stream.block_size, requests_hit, evicted)
