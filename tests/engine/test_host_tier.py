"""The host tier (engine/host_tier.py), by numbers written from its rules: an evicted device block
is copied to the host under its hash; a lookup goes on in the host tier where the device's hit
stops and loads those blocks back into fresh device blocks; the host pool evicts by its own
policy; a salt's chains never hit another's. Then the engine on a tiny model: greedy tokens equal
transformers' with the prefix from the device, from the host and half from each, the KV loaded
back equals the KV written bit for bit, and preemption with host copies changes no token."""

from __future__ import annotations

import pytest
import torch
from test_engine import hf_greedy, make, prompt

from kvscope.engine import KVCacheManager, SamplingParams
from kvscope.engine import events as ev
from kvscope.engine import explain as ex
from kvscope.engine.block_hash import short_hash
from kvscope.engine.kv_groups import NULL, KVGroup, group_key

BS = 4
A = list(range(10, 19))  # 9 tokens: 2 full blocks and one token
B = list(range(50, 63))  # 13 tokens: 3 full blocks and one token


def kinds(mgr, kind):
    return [e for e in mgr.events.drain() if e.kind == kind]


def test_evicted_blocks_go_to_the_host_and_come_back_as_a_hit():
    mgr = KVCacheManager(4, BS, host_blocks=8)
    assert mgr.admit(0, A) == 0
    a_blocks, a_hashes = mgr.block_table(0)[:2], mgr.seqs[0].hashes[:2]
    mgr.free(0)  # A's 2 full blocks cached, its third block free
    mgr.events.drain()
    assert mgr.admit(1, B) == 0  # 4 blocks: the 2 free ones, then A's 2, evicted (tail first)
    (off,) = kinds(mgr, ev.OFFLOADED)
    assert sorted(off.sources) == sorted(a_blocks)
    assert sorted(off.block_hashes) == sorted(short_hash(h) for h in a_hashes)
    assert sorted(mgr.host.pool.hash_to_block) == sorted(a_hashes)
    assert mgr.counters().num_offloaded_blocks == 2
    mgr.free(1)
    mgr.begin_step(1)

    assert mgr.admit(2, A) == 8  # both full blocks, from the host
    assert mgr.host_tokens(2) == 8 and mgr.counters().host_hit_tokens == 8
    events = mgr.events.drain()
    (load,) = [e for e in events if e.kind == ev.LOADED]
    assert list(load.destinations) == mgr.block_table(2)[:2]
    assert list(load.sources) == [mgr.host.pool.hash_to_block[h] for h in a_hashes]
    assert mgr.host.loads == list(zip(load.sources, load.destinations, strict=True))
    assert all(mgr.pool.hash_to_block[h] == b for h, b in zip(a_hashes, load.destinations,
                                                                  strict=True))
    assert set(a_hashes) <= set(mgr.host.pool.hash_to_block)  # a load is a copy
    why = mgr.explain_miss(2)
    assert why.reason == ex.FULL_HIT  # nothing missed: the whole prefix came back
    assert why.host_hit_blocks == 2 and "loaded back from the host tier" in why.message


def test_the_host_evicts_by_its_own_policy_and_a_hash_gone_from_both_misses():
    mgr = KVCacheManager(4, BS, host_blocks=2)
    mgr.admit(0, A)
    mgr.free(0)
    mgr.admit(1, B)  # A's 2 blocks offloaded: the host is full
    mgr.free(1)  # B's 3 full blocks cached on the device
    mgr.events.drain()
    mgr.admit(2, [7] * 13)  # 4 blocks: 1 free, then B's 3 evicted: 2 of them take A's places
    assert mgr.counters().num_host_evicted_blocks == 2
    (gone,) = kinds(mgr, ev.HOST_EVICTED)
    assert len(gone.blocks) == 2
    mgr.free(2)
    mgr.begin_step(1)
    assert mgr.admit(3, A) == 0  # on neither tier
    why = mgr.explain_miss(3)
    assert why.reason == ex.EVICTED and (why.dropped_at_step, why.host_dropped_at_step) == (0, 0)
    assert why.message.endswith("evicted at step 0, and its copy on the host tier evicted at "
                                "step 0.")


def test_a_salt_never_hits_another_salts_blocks_on_the_host():
    mgr = KVCacheManager(4, BS, host_blocks=8)
    mgr.admit(0, A, cache_salt="tenant-a")
    mgr.free(0)
    mgr.admit(1, B)
    mgr.free(1)
    mgr.begin_step(1)
    assert len(mgr.host.pool.hash_to_block) == 2
    assert mgr.admit(2, A, cache_salt="tenant-b") == 0
    mgr.free(2)
    assert mgr.admit(3, A, cache_salt="tenant-a") == 8


def test_two_device_copies_of_a_hash_evicted_together_make_one_host_copy():
    """A 4-token prompt looks nothing up (its last token is computed) yet caches its block: run
    twice, the device holds two copies of one hash; both evicted at once, the host takes one."""
    mgr = KVCacheManager(5, BS, host_blocks=4)
    mgr.admit(0, A)  # holds 3 of the 5 blocks
    for rid in (1, 2):
        mgr.admit(rid, [100] * 4)
        mgr.free(rid)
    (h,) = mgr.pool.copies
    mgr.free(0)
    mgr.admit(3, list(range(60, 80)))  # 5 blocks: every cached one evicted
    assert not mgr.host.pool.copies and h in mgr.host.pool.hash_to_block
    assert mgr.counters().num_offloaded_blocks == 3  # A's 2 full blocks and [100] * 4


def test_a_request_cancelled_while_its_blocks_load_leaves_no_block_held():
    """Cancelled in the step that loads it: its device blocks are released, and the host
    blocks it loads from stay held until the step's copies are made (the next step)."""
    mgr = KVCacheManager(4, BS, host_blocks=8)
    mgr.admit(0, A)
    mgr.free(0)
    mgr.admit(1, B)
    mgr.free(1)
    mgr.begin_step(1)
    assert mgr.admit(2, A) == 8
    held = [mgr.host.pool.hash_to_block[h] for h in mgr.seqs[2].hashes[:2]]
    mgr.free(2)  # cancelled before its forward pass
    assert all(r == 0 for r in mgr.pool.ref_count)
    assert [mgr.host.pool.ref_count[b] for b in held] == [1, 1]
    mgr.begin_step(2)
    assert all(r == 0 for r in mgr.host.pool.ref_count)


HYBRID = (KVGroup(), KVGroup(window=8))  # a window group needs 2 blocks of 4 before a hit
P = list(range(200, 217))  # 17 tokens: 4 full blocks and one


def test_a_hybrid_model_offloads_every_group_and_loads_only_the_window_it_needs():
    """P is freed (per group its tail first: group 0's 3 2 1 0, then group 1's); Q, a prompt
    of as many blocks, takes the 2 free ones and evicts P's 8: group 0's 3 2 1, then for
    group 1's table group 0's 0 and group 1's 3 2 1 0: three runs, three offloads, each in
    its group. P again hits 16 tokens from the host: full attention loads its 4 blocks, the
    window group only the 2 in its window at token 16 (positions 2 and 3), nulls before."""
    mgr = KVCacheManager(10, BS, groups=HYBRID, host_blocks=8)
    assert mgr.admit(0, P) == 0
    hashes = mgr.seqs[0].hashes[:4]
    mgr.free(0)
    mgr.events.drain()
    assert mgr.admit(1, list(range(300, 317))) == 0
    offloads = [(e.group, len(e.sources)) for e in kinds(mgr, ev.OFFLOADED)]
    assert offloads == [(0, 3), (0, 1), (1, 4)]
    assert sorted(mgr.host.pool.hash_to_block) == sorted(
        [*hashes, *(group_key(h, 1) for h in hashes)])
    assert sorted(mgr.host.pool.group) == [0] * 4 + [1] * 4
    mgr.free(1)
    mgr.begin_step(1)

    assert mgr.admit(2, P) == 16
    assert mgr.host_tokens(2) == 16
    events = mgr.events.drain()
    loads = {e.group: e for e in events if e.kind == ev.LOADED}
    assert {g: len(e.sources) for g, e in loads.items()} == {0: 4, 1: 2}
    h2b = mgr.host.pool.hash_to_block
    assert list(loads[1].sources) == [h2b[group_key(h, 1)] for h in hashes[2:]]
    full, window = mgr.block_tables(2)
    assert full[:4] == list(loads[0].destinations)
    assert window[:4] == [NULL, NULL, *loads[1].destinations]
    assert mgr.pool.hash_to_block[group_key(hashes[3], 1)] == window[3]
    assert mgr.counters().num_loaded_blocks == 6
    assert mgr.counters().host_hit_tokens == 16


def test_a_hybrid_hit_half_from_each_tier_loads_only_what_the_device_lacks():
    """R (2 blocks a group) takes the 2 free blocks and evicts group 0's 3 and 2 to the host;
    P again: full attention has blocks 0 1 on the device and 2 3 on the host, the window group
    its blocks 2 3 on the device: 16 tokens hit, 8 of them loaded (group 0's 2 blocks)."""
    mgr = KVCacheManager(10, BS, groups=HYBRID, host_blocks=8)
    mgr.admit(0, P)
    hashes = mgr.seqs[0].hashes[:4]
    device_window = mgr.block_tables(0)[1][2:4]
    mgr.free(0)
    mgr.admit(1, list(range(300, 305)))
    mgr.free(1)
    mgr.begin_step(1)
    mgr.events.drain()
    assert mgr.admit(2, P) == 16
    assert mgr.host_tokens(2) == 8
    (load,) = kinds(mgr, ev.LOADED)
    assert load.group == 0
    assert list(load.sources) == [mgr.host.pool.hash_to_block[h] for h in hashes[2:]]
    full, window = mgr.block_tables(2)
    assert full[2:4] == list(load.destinations)
    assert window[:4] == [NULL, NULL, *device_window]
    assert mgr.explain_miss(2).host_hit_blocks == 2


def test_a_window_run_never_puts_a_host_block_left_of_a_device_block():
    """The window group's block 2 on the host only, 3 on the device: one split per group
    (device blocks, then loaded ones) rules out the run 2 3; the run 1 2 (device, then host)
    ends the hit at 12, the window group loading block 2."""
    mgr = KVCacheManager(16, BS, groups=HYBRID, host_blocks=8)
    mgr.admit(0, P)
    hashes = mgr.seqs[0].hashes[:4]
    window = mgr.block_tables(0)[1]
    mgr.free(0)
    k2 = group_key(hashes[2], 1)
    mgr.pool.evicted_keys = [(window[2], k2, group_key(hashes[1], 1), 1)]
    mgr.pool.uncache(window[2])  # as an eviction of that one block
    mgr.host.offload_evicted(0, None)
    assert k2 in mgr.host.pool.hash_to_block and k2 not in mgr.pool.hash_to_block
    mgr.events.drain()
    assert mgr.admit(1, P) == 12 and mgr.host_tokens(1) == 4
    (load,) = kinds(mgr, ev.LOADED)
    assert load.group == 1 and mgr.block_tables(1)[1][:3] == [NULL, window[1],
                                                               *load.destinations]


PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("fillers, device, host", [((), 36, 0), ((48, 48), 0, 36),
                                                    ((36,), 20, 16)],
                         ids=["device", "host", "half"])
def test_greedy_tokens_equal_transformers_with_the_prefix_from_each_tier(
        tiny_llama, fillers, device, host):
    """A (40 tokens) runs and is freed on a 16-block pool; fillers evict none, all or the tail
    of A's blocks (LRU: A's tail was released first); B shares A's first 37 tokens."""
    _, hf = tiny_llama
    a = prompt(40, seed=1)
    b = a[:37] + prompt(6, seed=2)
    engine = make(tiny_llama, num_blocks=16, host_blocks=32)
    engine.generate([a], PARAMS)
    for i, n in enumerate(fillers):
        engine.generate([prompt(n, seed=3 + i)], PARAMS)
    out = engine.generate([b], PARAMS)[0]
    assert out.num_cached_tokens == device + host
    assert out.metrics.host_cached_tokens == host
    assert out.token_ids == hf_greedy(hf, b, 8)
    loaded = sum(r.loaded_blocks for r in engine.step_records)
    assert loaded * 4 == host


def test_the_kv_loaded_back_equals_the_kv_written_bit_for_bit(tiny_llama):
    a = prompt(40, seed=1)
    engine = make(tiny_llama, num_blocks=16, host_blocks=32)
    engine.generate([a], PARAMS)
    pool, kv = engine.manager.pool, engine.runner.kv_cache
    written = {h: kv[:, :, b].clone() for h, b in pool.hash_to_block.items()}
    for seed in (3, 4):  # evict every block of A to the host
        engine.generate([prompt(48, seed=seed)], PARAMS)
    assert not set(written) & set(pool.hash_to_block)
    loads = []
    engine.subscribe(lambda u: loads.extend(e for e in u.events if e.kind == ev.LOADED))
    out = engine.generate([a], PARAMS)[0]
    assert out.metrics.host_cached_tokens == 36
    by_short = {short_hash(h): before for h, before in written.items()}
    (load,) = loads
    assert len(load.destinations) == 9
    for b, h in zip(load.destinations, load.block_hashes, strict=True):
        assert torch.equal(kv[:, :, b], by_short[h])  # (blocks recomputed may differ in bits)


def test_preemption_with_host_copies_changes_no_token(tiny_llama):
    prompts = [prompt(30 + 3 * i, seed=10 + i) for i in range(5)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    want = [o.token_ids for o in make(tiny_llama).generate(prompts, params)]
    engine = make(tiny_llama, num_blocks=26, host_blocks=16)
    got = engine.generate(prompts + prompts[:2], params)
    assert sum(r.num_preempted for r in engine.step_records) > 0
    assert engine.counters().num_offloaded_blocks > 0
    assert [o.token_ids for o in got] == want + want[:2]
