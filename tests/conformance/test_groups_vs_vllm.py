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


def test_mooncake_trace_on_a_hybrid_model():
    """The Mooncake trace's first 200 requests, one at a time, full attention + a 1,024-token
    window at 2,048 blocks."""
    reqs = mooncake(DATA / "mooncake_conversation_head200.jsonl", 200)
    theirs = assert_same(reqs, 2048, sequential=True, windows=(1024,))
    assert total_hits(theirs) > 0
