"""Textbook prefix-caching scenarios at block size 16, with the explanation for each miss."""

import random

import pytest

from kvscope.engine import KVCacheManager, NoFreeBlocksError
from kvscope.engine import events as ev
from kvscope.engine import explain as ex

BS = 16


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(n)]


PREFIX = tokens(1800, seed=1)


def run_to_completion(mgr, rid, prompt, **kw):
    cached = mgr.admit(rid, prompt, **kw)
    mgr.free(rid)
    return cached


def test_shared_prefix_hits_112_blocks_and_computes_208_tokens():
    mgr = KVCacheManager(1024, BS)
    run_to_completion(mgr, 1, PREFIX + tokens(200, seed=2))
    second = PREFIX + tokens(200, seed=3)
    cached = mgr.admit(2, second)
    assert cached == 1792 and len(second) - cached == 208
    assert len(mgr.block_table(2)) == 125
    assert [e.blocks for e in mgr.events.drain() if e.kind == ev.CACHE_HIT][-1] == \
        tuple(mgr.block_table(2)[:112])
    why = mgr.explain_miss(2)
    assert (why.reason, why.first_miss_block, why.num_hit_blocks) == (ex.NEVER_STORED, 112, 112)
    snap = mgr.snapshot()
    assert snap.hit_tokens == 1792 and snap.query_tokens == 4000
    assert snap.request_hit_rate == 0.5


def test_one_different_token_at_position_3_hits_nothing():
    mgr = KVCacheManager(1024, BS)
    run_to_completion(mgr, 1, PREFIX + tokens(200, seed=2))
    changed = list(PREFIX)
    changed[3] += 1
    assert mgr.admit(2, changed + tokens(200, seed=2)) == 0
    why = mgr.explain_miss(2)
    assert (why.reason, why.first_miss_block) == (ex.NEVER_STORED, 0)
    assert "block 0 (tokens 0-15)" in why.message


def test_different_cache_salt_hits_nothing_and_says_why():
    mgr = KVCacheManager(1024, BS)
    prompt = PREFIX + tokens(200, seed=2)
    run_to_completion(mgr, 1, prompt, cache_salt="tenant-a")
    assert mgr.admit(2, prompt, cache_salt="tenant-b") == 0
    why = mgr.explain_miss(2)
    assert why.reason == ex.DIFFERENT_EXTRA_KEYS and why.differing_keys == ("cache_salt",)
    mgr.free(2)
    # The same salt still hits, and a different adapter is named as the difference.
    assert mgr.admit(3, prompt, cache_salt="tenant-a") == 1984
    mgr.free(3)
    assert mgr.admit(4, prompt, cache_salt="tenant-a", adapter="lora-1") == 0
    assert mgr.explain_miss(4).differing_keys == ("adapter",)


def test_different_model_never_shares():
    a = KVCacheManager(64, BS, model_fingerprint="model-a")
    b = KVCacheManager(64, BS, model_fingerprint="model-b")
    prompt = tokens(100, seed=5)
    for mgr in (a, b):
        run_to_completion(mgr, 1, prompt)
    assert a.pool.hash_to_block.keys().isdisjoint(b.pool.hash_to_block.keys())


@pytest.mark.parametrize("n", [1, 15, 16])
def test_prompt_of_at_most_one_block_never_hits(n):
    mgr = KVCacheManager(64, BS)
    prompt = tokens(n, seed=6)
    run_to_completion(mgr, 1, prompt)
    assert mgr.admit(2, prompt) == 0
    assert mgr.explain_miss(2).reason == ex.TOO_SHORT


def test_full_prompt_hit_still_computes_the_last_token():
    mgr = KVCacheManager(64, BS)
    prompt = tokens(64, seed=7)
    run_to_completion(mgr, 1, prompt)
    assert mgr.admit(2, prompt) == 48  # 3 of 4 blocks: the last block holds the last token
    assert mgr.explain_miss(2).reason == ex.FULL_HIT
    mgr.free(2)
    assert mgr.admit(3, prompt + [1]) == 64


def test_lru_eviction_takes_the_oldest_cached_block_first():
    mgr = KVCacheManager(8, BS)
    a, b = tokens(33, seed=8), tokens(33, seed=9)  # 3 blocks each: 2 full + 1 partial
    run_to_completion(mgr, 1, a)
    mgr.step = 1
    run_to_completion(mgr, 2, b)
    snap = mgr.snapshot()
    assert snap.num_cached_blocks == 4 and snap.num_free_blocks == 4
    mgr.events.drain()
    mgr.step = 2
    # 5 fresh blocks: 4 plain free blocks first, then the least recently used cached block,
    # which is the tail of request 1's chain (released tail first), not its head.
    assert mgr.admit(3, tokens(80, seed=10)) == 0
    evicted = [e for e in mgr.events.drain() if e.kind == ev.EVICTED]
    assert len(evicted) == 1 and evicted[0].request_id == 3
    req1_blocks = [blk for blk in range(8) if snap.owner[blk] == -1 and snap.last_use[blk] == 0
                   and snap.state[blk] == 3]
    assert len(req1_blocks) == 2
    next_victim, _ = sorted(req1_blocks, key=lambda blk: snap.lru_rank[blk])
    assert evicted[0].blocks == (next_victim,)
    # The evicted block was request 1's second block: a rerun of request 1 hits its first block
    # only and explain_miss names the eviction step.
    mgr.free(3)
    assert mgr.admit(4, a) == 16
    why = mgr.explain_miss(4)
    assert (why.reason, why.first_miss_block, why.dropped_at_step) == (ex.EVICTED, 1, 2)


def test_reset_drops_every_cached_prefix():
    mgr = KVCacheManager(64, BS)
    prompt = tokens(100, seed=11)
    run_to_completion(mgr, 1, prompt)
    mgr.step = 5
    mgr.reset_prefix_cache()
    assert mgr.snapshot().num_cached_blocks == 0
    assert mgr.admit(2, prompt) == 0
    why = mgr.explain_miss(2)
    assert (why.reason, why.dropped_by, why.dropped_at_step) == (ex.EVICTED, "reset", 5)


def test_caching_disabled_never_hits():
    mgr = KVCacheManager(64, BS, enable_prefix_caching=False)
    prompt = tokens(100, seed=12)
    run_to_completion(mgr, 1, prompt)
    assert mgr.admit(2, prompt) == 0
    assert mgr.explain_miss(2).reason == ex.CACHING_DISABLED
    assert mgr.snapshot().num_cached_blocks == 0


def test_generated_tokens_are_cached_for_the_next_turn():
    """A multi-turn chat that resends its history reuses the previous answer's full blocks."""
    mgr = KVCacheManager(64, BS)
    prompt, answer = tokens(40, seed=13), tokens(30, seed=14)
    mgr.admit(1, prompt)
    for t in answer:
        mgr.append_token_ids(1, [t])
        mgr.allocate(1, 1)
    mgr.free(1)
    next_turn = prompt + answer + tokens(20, seed=15)
    assert mgr.admit(2, next_turn) == 64  # 70 computed tokens = 4 full blocks


def test_fork_shares_full_blocks_and_copies_the_partial_one_on_divergence():
    mgr = KVCacheManager(64, BS)
    mgr.admit(1, tokens(40, seed=16))  # blocks 0,1 full, block 2 holds 8 tokens
    mgr.fork(1, 2)
    assert mgr.snapshot().ref_count[mgr.block_table(1)].tolist() == [2, 2, 2]
    mgr.append_token_ids(1, [5])
    copies = mgr.allocate(1, 1)
    t1, t2 = mgr.block_table(1), mgr.block_table(2)
    assert copies == [(t2[2], t1[2])] and t1[:2] == t2[:2] and t1[2] != t2[2]
    mgr.append_token_ids(2, [6])
    assert mgr.allocate(2, 1) == []  # now the sole owner: writes in place
    snap = mgr.snapshot()
    assert snap.num_shared_blocks == 2 and snap.num_cow_copies == 1
    assert [e.kind for e in mgr.events.drain()].count(ev.COW) == 1


def test_pool_exhaustion_changes_nothing():
    mgr = KVCacheManager(4, BS)
    assert mgr.admit(1, tokens(50, seed=17)) is not None  # 4 blocks
    before = mgr.snapshot()
    assert not mgr.can_admit(tokens(20, seed=18), 20)
    assert mgr.admit(2, tokens(20, seed=18)) is None
    mgr.append_token_ids(1, list(range(20)))
    assert not mgr.can_allocate(1, 20)
    with pytest.raises(NoFreeBlocksError):
        mgr.allocate(1, 20)
    assert mgr.num_computed_tokens(1) == 50
    assert mgr.snapshot().equals(before)
