"""Pool semantics against vLLM's own KVCacheManager (vllm==0.33.0, scripts/vllm-reference.txt):
the same calls on both give equal hit tokens, equal removals in the same order, and equal
resident sets (copies of one hash counted), step by step."""

from __future__ import annotations

from pathlib import Path

import pytest
from pool_sides import OurSide, VllmSide, content_names
from traffic import Req, mooncake, multi_turn, play

from kvscope.lab import whatif
from kvscope.lab.traces import load_trace

DATA = Path(__file__).parent.parent / "data"


def both(num_blocks: int, block_size: int = 16, windows: tuple = ()):
    """windows: KV-cache groups after a full-attention one (see pool_sides.VllmSide)."""
    return (VllmSide(num_blocks, block_size, windows=windows),
            OurSide(num_blocks, block_size, windows=windows))


def assert_same(reqs, num_blocks, sequential=False, block_size=16, windows=()):
    theirs, ours = (play(side, reqs, sequential=sequential)
                    for side in both(num_blocks, block_size, windows))
    for rid in theirs.hits:  # first the hits, the number a user reads
        assert ours.hits.get(rid) == theirs.hits[rid], f"request {rid}"
    assert ours.preempted == theirs.preempted
    for i, (a, b) in enumerate(zip(theirs.removed, ours.removed, strict=True)):
        assert a == b, f"operation {i} (step {a[0]}, request {a[1]}): removals differ"
    for step, (a, b) in enumerate(zip(theirs.resident, ours.resident, strict=True)):
        assert a == b, f"resident set after step {step}"
    return theirs


def names(salt, tokens, n):
    return content_names(salt, tokens[:n * 16], 16)


def test_a_fully_hit_block_aligned_prompt_keeps_a_copy_and_both_are_evicted():
    """Pool 4, one running: [0..31], the same again (its last block is recomputed: a second
    copy of h1), then 64 other tokens: vLLM removes h1, h1, h0."""
    a = list(range(32))
    for side in both(4):
        assert side.admit(0, a) == 0
        side.free(0)
        assert side.admit(1, a) == 16
        assert side.resident[names(None, a, 2)[1]] == 2  # two copies under one hash
        side.free(1)
        side.take_removed()
        assert side.admit(2, list(range(1000, 1064))) == 0
        h0, h1 = names(None, a, 2)
        assert side.take_removed() == [h1, h1, h0], type(side).__name__


def test_a_copy_filled_while_another_request_cached_it_serves_a_later_hit():
    """Pool 8, two running: A = 32 tokens; B = A's first 16 + the same next 16 decoded (B's
    block 1 fills while A's is cached: a copy); A ends; C evicts A's copy; D = A + 1 token
    still hits 32 tokens on B's copy."""
    a = list(range(32))
    for side in both(8):
        assert side.admit("A", a) == 0
        assert side.admit("B", a[:20]) == 16
        for t in a[20:] + [7, 8, 9]:
            assert side.decode("B", t)
        side.free("A")
        side.take_removed()
        assert side.admit("C", list(range(1000, 1080))) == 0
        assert side.take_removed() == [names(None, a, 2)[1]]  # A's block 1, not B's copy
        side.free("C")
        assert side.admit("D", a + [5]) == 32, type(side).__name__


def test_an_empty_salt_is_no_salt():
    a = list(range(40))
    for side in both(16):
        side.admit(0, a, salt=None)
        side.free(0)
        assert side.admit(1, a, salt="") == 32
        side.free(1)
        assert side.admit(2, a, salt="x") == 0


@pytest.mark.parametrize("seed,num_blocks", [(1, 24), (2, 40), (3, 64), (4, 200)])
def test_multi_turn_traffic_with_salts_and_eviction_pressure(seed, num_blocks):
    reqs = multi_turn(seed)
    theirs = assert_same(reqs, num_blocks)
    removed = sum(len(x[2]) for x in theirs.removed)
    copies = any(n > 1 for step in theirs.resident for _, n in step)
    assert sum(h for hits in theirs.hits.values() for h in hits) > 0 and copies  # what it tests
    if num_blocks < 100:
        assert removed > 0


def test_multi_turn_traffic_with_preemptions():
    reqs = multi_turn(7, users=8, turns=3)
    theirs = assert_same(reqs, 14)
    assert theirs.preempted


def test_mooncake_trace_sequential_and_the_lab_agree():
    """The Mooncake trace's first 200 requests at 2,048 blocks, one at a time: the same hits and
    removals on both, and the lab's what-if replay predicts the same total."""
    reqs = mooncake(DATA / "mooncake_conversation_head200.jsonl", 200)
    theirs = assert_same(reqs, 2048, sequential=True)
    hit = sum(h for hits in theirs.hits.values() for h in hits if h is not None)
    lab = whatif.replay(load_trace(DATA / "mooncake_conversation_head200.jsonl"), 2048)
    assert lab.hit_tokens == hit > 0
    assert lab.num_rejected == sum(None in hits for hits in theirs.hits.values()) > 0
    assert lab.evicted_blocks == sum(len(x[2]) for x in theirs.removed) > 0


def test_a_request_that_does_not_fit_waits_on_both():
    reqs = [Req(0, list(range(100)), [1] * 20), Req(1, list(range(500, 600)), [2] * 5)]
    theirs = assert_same(reqs, 8)
    assert theirs.hits == {0: [0], 1: [0]}
