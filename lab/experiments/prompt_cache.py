"""prompt-cache-ttl: prompt caching as an API bills it, on prefixes that come back at different
intervals. Each of a few tenants sends its own 4,096-token system prompt (the breakpoint: only
it is cached) and a 512-token message, at Poisson arrivals of its own mean gap; the trace is
billed under the example 5-minute and 1-hour prices, each at its TTL (lab.billing: the real
KVCacheManager with the ttl policy). No model is needed."""

from __future__ import annotations

import random

from kvscope.lab import billing
from kvscope.lab.experiments.result import Result
from kvscope.lab.traces import LabRequest, Trace

NAME = "prompt-cache-ttl"
CLAIM = ("Caching a prefix pays only if it is read more than (w - 1) / (1 - r) times per write "
         "before it expires: infrequent prefixes repeatedly expire, and their write premiums "
         "exceed their read savings.")
GAPS_S = (20, 60, 300, 900, 3600)  # each tenant's mean gap between requests
PRESETS = ("anthropic-5m", "anthropic-1h")
SYSTEM, MESSAGE, TRACE_BLOCK = 4096, 512, 512


def tenants_trace(hours: float, seed: int = 0) -> Trace:
    """One system prompt per mean gap in GAPS_S, each request its own message after it."""
    arrivals = []
    for k, gap in enumerate(GAPS_S):
        rng, t = random.Random(seed * 1000 + k), 0.0
        while (t := t + rng.expovariate(1 / gap)) < hours * 3600:
            arrivals.append((t, k))
    arrivals.sort()
    per = SYSTEM // TRACE_BLOCK
    own = len(GAPS_S) * per
    requests = [LabRequest(t, SYSTEM + MESSAGE, 64, (*range(k * per, (k + 1) * per), own + i),
                           breakpoint=SYSTEM) for i, (t, k) in enumerate(arrivals)]
    return Trace(f"{len(GAPS_S)} tenants", "mooncake", TRACE_BLOCK, requests, 0)


def measure(bench, quick: bool = False) -> Result:
    bench.plan(len(PRESETS))
    trace = tenants_trace(6.0 if quick else 24.0)
    bills = []
    for preset in PRESETS:
        prices, ttl = billing.PRESETS[preset]
        bills.append((preset, billing.run(trace, ttl, prices)))
        bench.advance()
    return summarize(trace, bills)


def summarize(trace: Trace, bills: list[tuple[str, billing.Bill]]) -> Result:
    per = SYSTEM // TRACE_BLOCK
    tenant = [r.nodes[0] // per for r in trace.requests]
    rows, words = [], []
    for preset, bill in bills:
        p = bill.prices
        for k, gap in enumerate(GAPS_S):
            x = next(x for x in bill.prefixes
                     if x.start_token == 0 and tenant[x.first_request] == k)
            rows.append([preset, bill.ttl_s, gap, tenant.count(k), x.writes, x.hits,
                         x.hits / x.writes, p.break_even, x.saving(p),
                         "yes" if x.paid(p) else "no"])
        unpaid = [r[2] for r in rows[-len(GAPS_S):] if r[-1] == "no"]
        words.append(f"{preset} (TTL {bill.ttl_s:,.0f} s, break-even {p.break_even:.2f} hits "
                     f"per write): " + (f"the prompts sent every {', '.join(map(str, unpaid))} s "
                                        "on average did not pay for their writes" if unpaid else
                                        "every system prompt paid")
                     + f"; the trace {'saved' if bill.saving >= 0 else 'lost'} "
                       f"{abs(bill.saving):.1%}")
    return Result(NAME, CLAIM, ["prices", "TTL s", "mean gap s", "requests", "writes", "hits",
                                "hits per write", "break-even", "saving $", "paid"], rows,
                  "; ".join(words), x="mean gap s", ys=["hits per write", "break-even"])
