"""The eviction-policy seam: which cached block each policy reuses first, at block size 16."""

import random

import pytest

from kvscope.engine import EngineConfig, KVCacheManager
from kvscope.engine import events as ev
from kvscope.engine.snapshot import CACHED

BS = 16
POLICIES = ["lru", "fifo", "lfu"]


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(n)]


A, B, C = tokens(33, 1), tokens(33, 2), tokens(33, 3)  # 2 full blocks + 1 token each


def run(mgr, rid, prompt):
    cached = mgr.admit(rid, prompt)
    mgr.free(rid)
    mgr.step += 1
    return cached


def evicted_by_next_admit(mgr, rid, n_tokens, seed):
    mgr.events.drain()
    mgr.admit(rid, tokens(n_tokens, seed))
    return [b for e in mgr.events.drain() if e.kind == ev.EVICTED for b in e.blocks]


def chain_blocks(mgr, prompt):
    """The physical blocks holding prompt's two full blocks (looked up by a dry hit)."""
    return mgr._lookup(mgr._chain(mgr._keys(None, None), prompt), len(prompt))[1][0]


@pytest.mark.parametrize("policy", POLICIES)
def test_plain_free_blocks_are_used_before_any_cached_block(policy):
    mgr = KVCacheManager(10, BS, eviction_policy=policy)
    run(mgr, 1, A)  # 3 blocks: 2 cached, 1 plain free again
    assert mgr.pool.num_cached == 2
    assert evicted_by_next_admit(mgr, 2, 8 * BS, seed=9) == []  # 8 blocks: no eviction
    mgr.free(2)
    assert run(mgr, 3, A) == 2 * BS


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("order, victims", [
    # hits: A 0, B 1, C 1; B released last
    ("ABCCB", {"lru": "A1 A0 C1 C0", "fifo": "A0 A1 B0 B1", "lfu": "A1 A0 C1 C0"}),
    # hits: A 0, B 1, C 2; B released last
    ("ABCCCB", {"lru": "A1 A0 C1 C0", "fifo": "A0 A1 B0 B1", "lfu": "A1 A0 B1 B0"}),
])
def test_each_policy_picks_its_own_victims(policy, order, victims):
    """lru: least recently released (tail first); fifo: registered first (head first); lfu:
    fewest hits, least recently released among equals."""
    mgr = KVCacheManager(9, BS, eviction_policy=policy)
    prompts = {"A": A, "B": B, "C": C}
    for rid, name in enumerate(order):
        run(mgr, rid, prompts[name])
    blocks = {f"{name}{i}": b for name, p in prompts.items()
              for i, b in enumerate(chain_blocks(mgr, p))}
    assert len(set(blocks.values())) == 6
    evicted = evicted_by_next_admit(mgr, 99, 7 * BS, seed=9)  # 3 free blocks + 4 cached ones
    assert evicted == [blocks[v] for v in victims[policy].split()]


@pytest.mark.parametrize("policy", POLICIES)
def test_snapshot_rank_is_the_order_of_eviction(policy):
    mgr = KVCacheManager(12, BS, eviction_policy=policy)
    for rid, prompt in enumerate([A, B, C, A, B, A]):
        run(mgr, rid, prompt)
    snap = mgr.snapshot()
    cached = [b for b in range(12) if snap.state[b] == CACHED]
    by_rank = sorted(cached, key=lambda b: snap.lru_rank[b])
    mgr.events.drain()
    mgr.admit(99, tokens(12 * BS - 1, seed=4))  # takes the whole pool
    evicted = [b for e in mgr.events.drain() if e.kind == ev.EVICTED for b in e.blocks]
    assert evicted == by_rank and len(evicted) == 6


def test_reset_turns_cached_blocks_into_plain_free_ones_first_in_line():
    mgr = KVCacheManager(8, BS, eviction_policy="lfu")
    run(mgr, 1, B)
    run(mgr, 2, A)
    run(mgr, 3, A)
    chains = chain_blocks(mgr, A) + chain_blocks(mgr, B)
    mgr.reset_prefix_cache()
    assert mgr.pool.num_cached == 0
    assert mgr.pool.eviction_order()[:4] == sorted(chains)
    assert run(mgr, 4, A) == 0


@pytest.mark.parametrize("bad", ["LRU", "random", ""])
def test_unknown_policy_is_refused(bad):
    with pytest.raises(ValueError, match="eviction_policy must be one of lru, fifo, lfu"):
        EngineConfig(eviction_policy=bad)
    with pytest.raises(ValueError, match="lru, fifo, lfu"):
        KVCacheManager(4, BS, eviction_policy=bad)


def test_cli_option_reaches_the_engine_and_the_session_metadata(tmp_path, capsys):
    from kvscope.app.cli import main as cli
    from kvscope.sessions import SessionReader

    session = tmp_path / "lfu.kvscope"
    assert cli.main(["run", "--workload", "eviction_pressure", "--num-blocks", "48",
                     "--eviction-policy", "lfu", "--no-progress", "--threads", "1",
                     "--record", str(session)]) == 0
    with SessionReader(session) as s:
        assert s.meta.engine_config["eviction_policy"] == "lfu"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", "--eviction-policy", "random"])
    assert exit_.value.code == 2
    assert "invalid choice: 'random'" in capsys.readouterr().err
