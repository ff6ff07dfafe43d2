"""Prompt caching as an API bills it: a trace replayed through the real `KVCacheManager` under
the ttl policy (a cached block expires T seconds after its last use, on the trace's clock;
optionally a capacity too), priced per token.

Prices (`Prices`): input C per million tokens, a cache write costs w x C, a cache read r x C,
output its own price, and a prompt is cached only from `min_tokens` up. Caching a prefix pays
when its hits h after a write satisfy h (1 - r) > w - 1: `Prices.break_even`.

What a request may cache: its full blocks before its last token (that token is always
computed, as the engine does), up to its breakpoint (`LabRequest.breakpoint`, tokens; None:
every full block), and nothing when that is under `min_tokens`. Of that prefix the blocks the
cache still holds are read, the rest written (and cached); every other prompt token is uncached.
Block granularity: an API caches to the token, kvscope to the block (at most one block less).

Per prefix: every block is the chain from the root to it; blocks are grouped into prefixes,
runs of blocks down the tree with one child each and the same writes and reads, each with its
writes, hits (reads), and whether it paid: hits > writes x break_even.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvscope.lab import whatif
from kvscope.lab.traces import Trace

# Example prices, not a price list (edit them): $ per million tokens for Claude Sonnet 4 and the
# multipliers of Anthropic's prompt caching as its pricing page gave them in 2025 (5-minute
# writes 1.25x, 1-hour writes 2x, reads 0.1x, at least 1,024 tokens); OpenAI's automatic caching
# as announced in October 2024 (no write premium, reads 0.5x, at least 1,024 tokens) at
# GPT-4o's $2.50 / $10. Check the vendor's current page before relying on them.
PRESETS_SOURCE = ("example numbers, not a price list: Anthropic's prompt-caching pricing for "
                  "Claude Sonnet 4 as published in 2025, OpenAI's automatic caching as announced "
                  "in October 2024 (GPT-4o); check the vendor's current prices")
TTL_GRID_S = (60, 120, 300, 600, 1200, 1800, 3600, 7200)  # the cost-vs-TTL plot: 1 min to 2 h


@dataclass(frozen=True)
class Prices:
    input: float = 3.0  # C: $ per million input tokens
    write: float = 1.25  # w: a cache write costs w x C
    read: float = 0.1  # r: a cache read costs r x C
    min_tokens: int = 1024  # the shortest prefix that is cached
    output: float = 15.0  # $ per million output tokens

    @property
    def break_even(self) -> float:
        """Hits per write above which a prefix pays: (w - 1) / (1 - r) (inf when r >= 1)."""
        if self.read >= 1:
            return math.inf
        return max(0.0, (self.write - 1) / (1 - self.read))

    def cost(self, uncached: int, written: int, read: int, output: int = 0) -> float:
        """Dollars for these tokens."""
        return (self.input * (uncached + self.write * written + self.read * read)
                + self.output * output) / 1e6

    def problem(self) -> str | None:
        """None, or the one-line reason these prices are not usable."""
        for name in ("input", "write", "read", "output"):
            if not getattr(self, name) >= 0:
                return f"{name} price must be >= 0, got {getattr(self, name):g}"
        if self.min_tokens < 0:
            return f"minimum cacheable tokens must be >= 0, got {self.min_tokens}"
        return None


# name -> (prices, the TTL in seconds it goes with); see PRESETS_SOURCE
PRESETS = {
    "anthropic-5m": (Prices(3.0, 1.25, 0.1, 1024, 15.0), 300.0),
    "anthropic-1h": (Prices(3.0, 2.0, 0.1, 1024, 15.0), 3600.0),
    "openai": (Prices(2.5, 1.0, 0.5, 1024, 10.0), 300.0),
}


@dataclass
class Prefix:
    """A run of blocks down the tree (root to `end_token` is the chain it ends)."""

    start_token: int
    end_token: int  # exclusive
    writes: int
    hits: int
    first_request: int  # the request that first wrote it

    @property
    def tokens(self) -> int:
        return self.end_token - self.start_token

    def paid(self, prices: Prices) -> bool:
        return self.hits > self.writes * prices.break_even

    def saving(self, prices: Prices) -> float:
        """Dollars caching saved on it (negative: it cost more than not caching)."""
        return prices.input * self.tokens * (
            self.writes * (1 - prices.write) + self.hits * (1 - prices.read)) / 1e6


@dataclass
class Bill:
    ttl_s: float | None
    pool_blocks: int
    prices: Prices
    num_requests: int = 0
    requests_read: int = 0  # requests that read something from the cache
    input_tokens: int = 0
    output_tokens: int = 0
    written_tokens: int = 0
    read_tokens: int = 0
    expired_blocks: int = 0
    evicted_blocks: int = 0
    prefixes: list[Prefix] = field(default_factory=list)

    @property
    def uncached_tokens(self) -> int:
        return self.input_tokens - self.written_tokens - self.read_tokens

    @property
    def cost(self) -> float:
        return self.prices.cost(self.uncached_tokens, self.written_tokens, self.read_tokens,
                                self.output_tokens)

    @property
    def cost_without_cache(self) -> float:
        return self.prices.cost(self.input_tokens, 0, 0, self.output_tokens)

    @property
    def token_hit_ratio(self) -> float:
        return self.read_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def request_hit_ratio(self) -> float:
        return self.requests_read / self.num_requests if self.num_requests else 0.0

    @property
    def saving(self) -> float:
        """1 - cost / cost without caching (negative: caching cost more)."""
        base = self.cost_without_cache
        return 1 - self.cost / base if base else 0.0


def cacheable_blocks(input_length: int, breakpoint: int | None, block_size: int,
                     prices: Prices) -> int:
    """The full blocks a request may cache (see the module docstring)."""
    end = input_length - 1 if breakpoint is None else min(breakpoint, input_length - 1)
    blocks = max(0, end) // block_size
    return blocks if blocks and blocks * block_size >= prices.min_tokens else 0


def run(trace: Trace, ttl_s: float | None, prices: Prices, block_size: int = 16,
        pool_blocks: int | None = None, mode: str = "sequential", tpot_s: float = 0.03,
        prefill_s: float = 0.0, hashes: list[list[bytes]] | None = None) -> Bill:
    """Replay the trace under the ttl policy (ttl_s None: nothing expires) and bill it.
    pool_blocks: a capacity too (None: as many blocks as could ever be live)."""
    hashes = hashes if hashes is not None else whatif.block_hashes(trace, block_size)
    cut = [cacheable_blocks(r.input_length, r.breakpoint, block_size, prices)
           for r in trace.requests]
    given = [h[:c] for h, c in zip(hashes, cut, strict=True)]
    if pool_blocks is None:
        pool_blocks = _unbounded(trace, given, cut, block_size, mode)
    mgr = whatif.new_manager(trace, pool_blocks, block_size, "ttl", None, 0, "lru",
                             ttl_s=ttl_s)
    pool = whatif.new_pool(mode, mgr, trace, given, tpot_s, prefill_s)
    hits: dict[int, int] = {}
    pool.on_count = lambda i, cached: hits.__setitem__(i, cached // block_size)
    for i, r in enumerate(trace.requests):
        pool.arrive(i, r.arrival_s)
    pool.finish_until(math.inf)
    bill = Bill(ttl_s, pool_blocks, prices, len(trace.requests),
                input_tokens=sum(r.input_length for r in trace.requests),
                output_tokens=sum(r.output_length for r in trace.requests),
                expired_blocks=mgr.pool.num_expired, evicted_blocks=mgr.pool.num_evicted)
    stats: dict[bytes, list[int]] = {}  # block key -> [writes, hits, parent index, request]
    for i, h in sorted(hits.items()):
        bill.requests_read += h > 0
        bill.read_tokens += h * block_size
        bill.written_tokens += (cut[i] - h) * block_size
        for j, key in enumerate(given[i]):
            s = stats.setdefault(key, [0, 0, j, i])
            s[j < h] += 1  # a hit below h, else a write
    bill.prefixes = prefixes(stats, given, block_size)
    return bill


def _unbounded(trace: Trace, given, cut, block_size: int, mode: str) -> int:
    """A pool no replay of this trace fills: every distinct cacheable block, plus each
    request's other blocks (its prompt's rest; its output in timed mode)."""
    rest = sum(-(-(r.input_length + (r.output_length if mode == "timed" else 0)) // block_size)
               - c for r, c in zip(trace.requests, cut, strict=True))
    return len({k for h in given for k in h}) + rest + 1


def prefixes(stats: dict[bytes, list[int]], given, block_size: int) -> list[Prefix]:
    """Blocks grouped into runs down the tree: a block joins its parent's run when it is the
    parent's only child and has the same writes and hits."""
    parent, children = {}, {}
    for h in given:
        for j in range(1, len(h)):
            if h[j] not in parent:
                parent[h[j]] = h[j - 1]
                children[h[j - 1]] = children.get(h[j - 1], 0) + 1
    runs: dict[bytes, Prefix] = {}
    run_of: dict[bytes, bytes] = {}
    for key, (writes, hits, depth, first) in stats.items():  # (parents come first)
        p = parent.get(key)
        if p is not None and children[p] == 1 and stats[p][:2] == [writes, hits]:
            start = run_of[key] = run_of[p]
            runs[start].end_token = (depth + 1) * block_size
        else:
            run_of[key] = key
            runs[key] = Prefix(depth * block_size, (depth + 1) * block_size, writes, hits, first)
    return list(runs.values())


def cost_curve(trace: Trace, prices: Prices, ttls=TTL_GRID_S, **kw) -> list[tuple[float, float]]:
    """(TTL s, cost with caching) at each TTL; kw: run()'s."""
    kw["hashes"] = kw.get("hashes") or whatif.block_hashes(trace, kw.get("block_size", 16))
    return [(t, run(trace, t, prices, **kw).cost) for t in ttls]


def verdict(bill: Bill) -> str:
    """One line: what caching did to the bill, and how many prefixes paid for their writes."""
    p = bill.prices
    paid = [x for x in bill.prefixes if x.paid(p)]
    unpaid = sum(x.tokens * x.writes for x in bill.prefixes if not x.paid(p))
    ttl = "no TTL" if bill.ttl_s is None else f"TTL {bill.ttl_s:,.0f} s"
    verb = "saves" if bill.cost <= bill.cost_without_cache else "costs"
    return (f"{ttl}: caching {verb} {abs(bill.saving):.1%} (${bill.cost:,.4f} vs "
            f"${bill.cost_without_cache:,.4f}); {len(paid):,} of {len(bill.prefixes):,} prefixes "
            f"paid for their writes (break-even: more than {p.break_even:.2f} hits per write); "
            f"{unpaid:,} tokens written to prefixes that did not")
