"""The host tier's running totals in CacheCounters (engine.host_tier): a hand scenario on a pool
of 4 blocks of 4 tokens and a host tier of 3 blocks, each number worked out from the tier's
rules; and all zero without a tier."""

from __future__ import annotations

from kvscope.engine import CacheCounters, KVCacheManager

A = list(range(10, 19))  # 9 tokens: full blocks a0 a1, then one token
B = list(range(50, 63))  # 13 tokens: full blocks b0 b1 b2, then one token


def host(c: CacheCounters) -> tuple[int, int, int, int]:
    return c.host_hit_tokens, c.num_offloaded_blocks, c.num_loaded_blocks, \
        c.num_host_evicted_blocks


def test_counters_per_tier_follow_a_hand_scenario():
    m = KVCacheManager(4, 4, host_blocks=3)
    m.admit(0, A)
    m.free(0)  # a0 a1 cached, their partial block free
    m.admit(1, B)  # 4 blocks: the 2 free, then a1 and a0 evicted: both offloaded
    c = m.counters()
    assert (c.num_evicted_blocks, c.hit_tokens, c.query_tokens) == (2, 0, 22)
    assert host(c) == (0, 2, 0, 0)
    m.free(1)  # b0 b1 b2 cached (b2 first to go), b3 free
    m.begin_step(1)

    # A again: a0 a1 from the host (8 tokens, 2 loads) into b3's free block and b2's (evicted,
    # offloaded: the host's third block); its last token takes b1's (evicted; the host's
    # blocks are a0 a1, held while they load, and b2: b2 is evicted from the host for b1)
    assert m.admit(2, A) == 8
    c = m.counters()
    assert (c.num_evicted_blocks, c.hit_tokens, c.num_requests_hit) == (4, 8, 1)
    assert host(c) == (8, 4, 2, 1)
    m.free(2)
    m.begin_step(2)

    # B again: b0 on the device, b1 from the host (4 tokens, 1 load, into A's free block),
    # b2 gone from both: the 2 blocks it still needs evict a1 and a0, which the host holds
    # already (no copy)
    assert m.admit(3, B) == 8
    c = m.counters()
    assert (c.num_evicted_blocks, c.hit_tokens, c.query_tokens) == (6, 16, 44)
    assert host(c) == (12, 4, 3, 1)
    assert m.snapshot().counters == c  # the snapshot carries them as they are


def test_without_a_host_tier_the_host_counters_stay_zero():
    m = KVCacheManager(4, 4)
    for rid, tokens in enumerate((A, B, A, B)):
        m.begin_step(rid)
        m.admit(rid, tokens)
        m.free(rid)
    c = m.counters()
    assert c.num_evicted_blocks > 0 and host(c) == (0, 0, 0, 0)
