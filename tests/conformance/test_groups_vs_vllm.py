"""KV-cache groups against vLLM's own KVCacheManager (vllm==0.33.0) with a hybrid config (its
HybridKVCacheCoordinator over FullAttentionSpec and SlidingWindowSpec groups): the same calls
give equal hits, equal removals per group in the same order, equal resident sets per group and
equal preemptions, step by step. `windows`: the groups after a full-attention one (None first:
no full-attention group)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_pool_vs_vllm import assert_same
from traffic import mooncake, multi_turn

from kvscope.engine.kv_groups import KVGroup
from kvscope.lab import whatif
from kvscope.lab.replay import WhatIfReplay
from kvscope.lab.traces import load_trace

DATA = Path(__file__).parent.parent / "data"


def total_hits(trace) -> int:
    return sum(h for hits in trace.hits.values() for h in hits if h)


@pytest.mark.parametrize("windows", [(5,), (None, 7), (8, 40)],
                         ids=["full+window5", "window7", "full+window8+window40"])
@pytest.mark.parametrize("seed,num_blocks", [(1, 40), (4, 30)])
def test_multi_turn_traffic_with_sliding_windows(windows, seed, num_blocks):
    reqs = multi_turn(seed)
    theirs = assert_same(reqs, num_blocks, windows=windows)
    full_only = assert_same(reqs, num_blocks)  # the same traffic with one full group
    assert total_hits(theirs) != total_hits(full_only)  # the windows changed what hit


def test_mooncake_trace_on_a_hybrid_model_and_the_labs_hybrid_replay():
    """The Mooncake trace's first 200 requests, one at a time, full attention + a 1,024-token
    window at 2,048 blocks; the lab's hybrid what-if replay of the trace (its own loader, block
    ids for hashes) predicts vLLM's hits request by request, its rejections and evictions."""
    path = DATA / "mooncake_conversation_head200.jsonl"
    reqs = mooncake(path, 200)
    theirs = assert_same(reqs, 2048, sequential=True, windows=(1024,))
    assert total_hits(theirs) > 0
    groups = (KVGroup(), KVGroup(window=1024))
    trace = load_trace(path)
    steps = WhatIfReplay(trace, 2048, 16, groups=groups)
    steps.run()
    assert [r.hit_tokens for r in steps.records] == [theirs.hits[i][0] or 0
                                                      for i in range(200)]
    lab = whatif.replay(trace, 2048, 16, groups=groups)
    assert lab.hit_tokens == total_hits(theirs) < whatif.replay(trace, 2048, 16).hit_tokens
    assert lab.num_rejected == sum(None in hits for hits in theirs.hits.values()) > 0
    assert lab.evicted_blocks == sum(len(x[2]) for x in theirs.removed) > 0
