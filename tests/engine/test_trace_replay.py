"""A slice of the public Mooncake conversation trace through the cache manager."""

from pathlib import Path

import pytest

from kvscope.engine import KVCacheManager
from kvscope.engine.trace_replay import TRACE_BLOCK, load_mooncake, replay

TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_head200.jsonl"
BS = 16
SLICE = 200


@pytest.fixture(scope="module")
def requests():
    return load_mooncake(TRACE, limit=SLICE)


def ideal_hit_tokens(requests):
    """An independent oracle for a pool that never evicts: a request reuses the longest run of
    16-token blocks that an earlier request already had, leaving its last token to compute.
    Prefixes are nodes of an exact trie: (parent node, block tokens) -> node."""
    trie: dict[tuple, int] = {}
    total = 0
    for r in requests:
        tokens = r.prompt_token_ids()
        hittable, node, hit, missed = (len(tokens) - 1) // BS, -1, 0, False
        for i in range(len(tokens) // BS):
            key = (node, tuple(tokens[i * BS : (i + 1) * BS]))
            if key in trie:
                hit += not missed and i < hittable
            else:
                missed = True
                trie[key] = len(trie)
            node = trie[key]
        total += hit * BS
    return total


def test_token_expansion_keeps_the_prefix_structure(requests):
    a, b = requests[0], requests[1]  # both start with hash id 0, then differ
    assert a.hash_ids[0] == b.hash_ids[0] and a.hash_ids[1] != b.hash_ids[1]
    ta, tb = a.prompt_token_ids(), b.prompt_token_ids()
    assert len(ta) == a.input_length
    assert ta[:TRACE_BLOCK] == tb[:TRACE_BLOCK] and ta[TRACE_BLOCK] != tb[TRACE_BLOCK]


def test_huge_pool_matches_the_never_evicting_oracle(requests):
    mgr = KVCacheManager(400_000, BS, record_events=False)
    result = replay(mgr, requests)
    assert result.num_evicted_blocks == 0
    assert result.query_tokens == sum(r.input_length for r in requests)
    assert result.hit_tokens == ideal_hit_tokens(requests)
    assert result.hit_tokens > 0.03 * result.query_tokens  # the slice does share prefixes


def test_small_pool_evicts_and_hits_less(requests):
    big = replay(KVCacheManager(400_000, BS, record_events=False), requests)
    small = replay(KVCacheManager(8_000, BS, record_events=False), requests)
    assert small.num_evicted_blocks > 0
    assert small.hit_tokens < big.hit_tokens
    too_big = sum(r.input_length + r.output_length > 8_000 * BS for r in requests)
    assert small.num_requests == SLICE and small.num_rejected == too_big
