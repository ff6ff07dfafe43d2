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

from kvscope.engine.lab.traces import Trace


@dataclass
class SegmentStream:
    """requests[i] = [(segment, units, hittable units), ...] in prompt order."""

    requests: list[list[tuple[int, int, int]]]
    block_size: int
    query_tokens: int
    num_segments: int


def segment_stream(trace: Trace, block_size: int) -> SegmentStream:
    trace.check_block_size(block_size)
    k = trace.trace_block // block_size
    cuts: dict[int, set[int]] = {}
    for r in trace.requests:
        q, p = divmod(r.input_length // block_size, k)
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
    return SegmentStream(out, block_size, sum(r.input_length for r in trace.requests),
                         len(seg_id))


def infinite_hit_tokens(stream: SegmentStream) -> int:
    seen: set[int] = set()
    hits = 0
    for refs in stream.requests:
        prefix = True
        for s, _, h in refs:
            prefix = prefix and s in seen
            hits += h if prefix else 0
        seen.update(s for s, _, _ in refs)
    return hits * stream.block_size


def lru_hit_tokens(stream: SegmentStream, pool_sizes: list[int]) -> list[int]:
    """Hit tokens of an LRU prefix cache of each size, from one pass of stack distances. A
    request looks up its prompt, then its blocks go to the top of the stack head first (the
    manager releases them tail first), so depth d (0 = top) hits at sizes > d."""
    n_slots = sum(len(refs) for refs in stream.requests) + 1
    tree = [0] * (n_slots + 1)  # Fenwick tree over access times: the weight of the last access
    last: dict[int, int] = {}
    total = 0  # weight of all live slots
    points: dict[int, int] = {}  # threshold -> hit blocks needing at least that size
    lo_list, hi_list = [], []  # ranges of thresholds, one hit block each
    now = 0
    for refs in stream.requests:
        prefix_max = -1  # deepest depth so far among this prompt's hittable blocks
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


def belady_hit_tokens(stream: SegmentStream, pool_blocks: int) -> int:
    """Belady's MIN: on overflow, drop the block whose next use is farthest (possibly the one
    just used). A child's next use is always after its parent's (every prompt that holds the
    child holds the parent before it), so the cache stays prefix-closed and MIN's block hits are
    prefix hits: no policy of this pool size can beat it."""
    order = [s for refs in stream.requests for s, _, _ in refs]
    never = len(order)
    following = [never] * len(order)  # index of the next reference to the same segment
    seen: dict[int, int] = {}
    for i in range(len(order) - 1, -1, -1):
        following[i] = seen.get(order[i], never)
        seen[order[i]] = i
    resident: dict[int, int] = {}  # segment -> units held (always its leading units)
    next_use: dict[int, int] = {}
    heap: list[tuple[int, int]] = []  # (-next use, segment), stale entries skipped
    held = hits = 0
    i = 0
    for refs in stream.requests:
        prefix = True
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
                if resident[v]:
                    heapq.heappush(heap, (neg, v))
                else:
                    del resident[v]
    return hits * stream.block_size
