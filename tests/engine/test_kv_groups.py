"""KV-cache groups in the cache manager: the numbers written from vLLM's rules by hand
(SlidingWindowManager, HybridKVCacheCoordinator; tests/conformance/test_groups_vs_vllm.py
checks the same rules against vLLM's own code on traffic).

Block size 4, a full-attention group and a sliding window of 8 tokens: a hit of h tokens needs
the window group's cdiv(8 - 1, 4) = 2 blocks before h cached; after n tokens are computed the
window group no longer needs the blocks wholly before token n - 8 + 1."""

from __future__ import annotations

import numpy as np

from kvscope.engine import events as ev
from kvscope.engine import explain as ex
from kvscope.engine.dead import dead_blocks_in_pool, dead_blocks_in_snapshot
from kvscope.engine.kv_cache_manager import KVCacheManager
from kvscope.engine.kv_groups import NULL, KVGroup, group_key, groups_of

BS, W = 4, 8
GROUPS = (KVGroup(), KVGroup(W))
A = list(range(100, 132))  # 32 tokens: 8 full blocks


def run_a(num_blocks: int) -> tuple[KVCacheManager, list[list[int]]]:
    """A admitted whole, then one decode token: its window group lets go of blocks 0-5."""
    mgr = KVCacheManager(num_blocks, BS, groups=GROUPS)
    assert mgr.admit(0, A) == 0
    tables = [t[:] for t in mgr.block_tables(0)]
    mgr.events.drain()
    mgr.append_token_ids(0, [7])
    mgr.allocate(0, 1)
    return mgr, tables


def test_blocks_leave_the_window_mid_request_and_still_hit_while_cached():
    mgr, (full, window) = run_a(32)
    # 32 tokens computed: the next query (position 32) sees tokens 25..32, so blocks 0-5
    # (tokens 0-23) are released, tail first; a null stays in their place
    released = [e for e in mgr.events.drain() if e.kind == ev.OUT_OF_WINDOW]
    assert [(e.group, e.blocks) for e in released] == [(1, tuple(window[5::-1]))]
    assert mgr.block_table(0, 1)[:7] == [NULL] * 6 + [window[6]]
    assert mgr.block_table(0, 0)[:8] == full  # full attention keeps every block
    pool = mgr.pool
    assert all(pool.ref_count[b] == 0 for b in window[:6])
    assert all(pool.hash_to_block[group_key(mgr.seqs[0].hashes[i], 1)] == window[i]
               for i in range(6))  # still cached: no "removed" until evicted
    assert pool.counts().cached == 6

    # C shares A's first 16 tokens: full attention hits blocks 0-3; the window group needs
    # blocks 2 and 3 (released, still cached) and takes them back, nulls before them
    assert mgr.admit(1, A[:16] + [999]) == 16
    assert mgr.block_table(1, 0)[:4] == full[:4]
    assert mgr.block_table(1, 1)[:4] == [NULL, NULL, window[2], window[3]]
    assert pool.ref_count[window[2]] == pool.ref_count[window[3]] == 1
    hits = [e for e in mgr.events.drain() if e.kind == ev.CACHE_HIT]
    assert [(e.group, e.blocks) for e in hits] == [
        (0, tuple(full[:4])), (1, (NULL, NULL, window[2], window[3]))]


def test_the_hit_is_the_shortest_any_group_accepts_and_hashes_never_match_across_groups():
    """Pool 20: A holds 9 blocks of full attention and 3 of the window after its decode, 2
    are free; its 6 released window blocks are cached, oldest first in release order (block 5
    first). D (12 new tokens: 3 blocks per group) takes the 2 free ones and evicts window blocks
    5, 4, 3, 2, then ends (its blocks cached behind A's blocks 1 and 0)."""
    mgr, (full, window) = run_a(20)
    assert mgr.pool.num_available == 8
    assert mgr.admit(2, list(range(500, 512))) == 0
    evicted = [b for e in mgr.events.drain() if e.kind == ev.EVICTED for b in e.blocks]
    assert evicted == [window[5], window[4], window[3], window[2]]
    mgr.free(2)
    # C = A's first 16 tokens + 1: full attention reaches 16 tokens (blocks 0-3, held by A,
    # under the same hashes the window group's lost blocks had). The window group, scanning
    # from the right within 4 blocks: 3 and 2 missing, then 1 and 0 cached: a run of 2 ending
    # at block 1, so it accepts 8 tokens; the hit is 8.
    assert mgr.admit(1, A[:16] + [999]) == 8
    assert mgr.block_table(1, 0)[:2] == full[:2]
    assert mgr.block_table(1, 1)[:2] == window[:2]  # (8 - 8 + 1) // 4 = 0 blocks skipped
    why = mgr.explain_miss(1)
    assert (why.reason, why.cut_by_group, why.reach_blocks, why.group_blocks_needed,
            why.group_blocks_found, why.num_hit_tokens) == (
        ex.WINDOW_CUT, "sliding window 8", 4, 2, 0, 8)
    assert why.message == (
        "2 block(s) (8 tokens) reused: full attention cached 16 tokens; the sliding window 8 "
        "group had 0 of the 2 blocks it needs right before token 16, so the hit is 8 tokens "
        "(every group must accept a hit).")


def test_an_all_windowed_model_hits_on_the_last_blocks_only():
    """One group, window 8 (Mistral-like): after A ends (every block cached), A again + 1
    token hits all 32 tokens although only its blocks 6 and 7 are taken."""
    mgr = KVCacheManager(32, BS, groups=(KVGroup(W),))
    mgr.admit(0, A)
    table = mgr.block_table(0)[:]
    mgr.free(0)
    assert mgr.admit(1, A + [5]) == 32
    assert mgr.block_table(1)[:8] == [NULL] * 6 + table[6:8]  # (32 - 8 + 1) // 4 = 6 skipped
    assert sum(r > 0 for r in mgr.pool.ref_count) == 3  # blocks 6, 7 and a fresh one


def test_groups_of_a_models_layers():
    assert groups_of([None, 6, None, 6]) == (KVGroup(None, (0, 2)), KVGroup(6, (1, 3)))
    assert groups_of([7, 7]) == (KVGroup(7, (0, 1)),)
    assert groups_of([None, None]) == (KVGroup(None, (0, 1)),)
    assert group_key(b"h" * 32, 0) == b"h" * 32 != group_key(b"h" * 32, 1)


def test_a_window_block_is_dead_when_full_attention_lost_its_tokens_not_its_window_parent():
    """A (41 tokens, then one more) leaves 8 window blocks released and 3 held; freed, all cached.
    B's 4 blocks evict the window blocks released first (the parent of A's held window blocks):
    nothing is dead, a window needs no earlier block. B's next 20 tokens evict full attention's
    tail (blocks 7-10): the window blocks of the same tokens (8, 9) are dead, a hit never reaches
    them; a windows-only model has no dead block."""
    import random

    rng = random.Random(0)
    a = [rng.randrange(1000) for _ in range(41)]
    mgr = KVCacheManager(23, BS, groups=(KVGroup(), KVGroup(window=W, layers=(1,))))
    mgr.admit(1, a)
    mgr.append_token_ids(1, [5])
    mgr.allocate(1, 1)
    full, window = mgr.block_table(1, 0)[:], mgr.block_table(1, 1)[:]
    assert window[:8] == [NULL] * 8
    mgr.free(1)

    def dead() -> list[int]:
        mask = dead_blocks_in_pool(mgr.pool, mgr.groups)
        assert (mask == dead_blocks_in_snapshot(mgr.snapshot(), mgr.pool.chain_roots)).all()
        return np.flatnonzero(mask).tolist()

    mgr.admit(2, [rng.randrange(1000) for _ in range(8)])
    assert mgr.pool.block_hash[window[8]] is not None  # cached, its window parent evicted
    assert dead() == []
    mgr.append_token_ids(2, list(range(20)))
    mgr.allocate(2, 20)
    assert [mgr.pool.ref_count[b] for b in full[6:10]] == [0, 1, 1, 1]  # 7-9 are B's now
    assert dead() == window[8:10]

    only = KVCacheManager(8, BS, groups=(KVGroup(window=W),), eviction_policy="fifo")
    only.admit(1, a[:13])
    only.free(1)
    only.admit(2, a[20:28])  # fifo: evicts the chain's head
    assert np.flatnonzero(dead_blocks_in_pool(only.pool, only.groups)).tolist() == []
