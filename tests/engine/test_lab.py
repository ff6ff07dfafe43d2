"""The cache lab on the head of the real Mooncake conversation trace and on small hand-made
traces: the manager's what-if replay against an independent plain-dict LRU, the one-pass LRU
curve against the manager, Belady against brute force, dead cache live and in the lab."""

from __future__ import annotations

import json
import random
from functools import cache
from pathlib import Path

import pytest
from plain_lru import plain_lru_hit_ratio

from kvscope.engine import KVCacheManager
from kvscope.engine.dead import dead_blocks_in_pool, dead_blocks_in_snapshot
from kvscope.lab import ceilings, whatif
from kvscope.lab.residency import Residency
from kvscope.lab.traces import LabRequest, Trace, TraceError, load_trace

HEAD = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_head200.jsonl"
BS = 16
SIZES = [500, 2_000, 8_000, 30_000]


@pytest.fixture(scope="module")
def trace():
    return load_trace(HEAD)


@pytest.mark.parametrize("size", SIZES)
def test_manager_lru_and_one_pass_curve_agree_with_a_plain_lru(trace, size):
    want = plain_lru_hit_ratio(HEAD, size)
    got = whatif.replay(trace, size, BS, "lru").token_hit_ratio
    stream = ceilings.segment_stream(trace, BS)
    (curve,) = ceilings.lru_hit_tokens(stream, [size])
    assert abs(got - want) < 0.005, (got, want)
    assert abs(curve / stream.query_tokens - got) < 0.005


def test_belady_bounds_every_policy_and_meets_the_infinite_cache(trace):
    stream = ceilings.segment_stream(trace, BS)
    infinite = ceilings.infinite_cache(stream).hit_tokens
    for size in SIZES[1:3]:
        best = ceilings.belady(stream, size).hit_tokens
        for policy in ("lru", "fifo", "lfu"):
            r = whatif.replay(trace, size, BS, policy)
            assert r.hit_tokens <= best <= infinite, (policy, size)
    assert ceilings.belady(stream, 10**7).hit_tokens == infinite > 0


def test_timed_and_sequential_meet_the_infinite_cache_on_a_huge_pool(trace):
    stream = ceilings.segment_stream(trace, BS)
    infinite = ceilings.infinite_cache(stream)
    assert infinite.hit_tokens == round(plain_lru_hit_ratio(HEAD, 10**9) * stream.query_tokens)
    for mode in ("sequential", "timed"):
        r = whatif.replay(trace, 10**6, BS, "lru", mode)
        assert (r.hit_tokens, r.num_requests_hit) == (infinite.hit_tokens, infinite.requests_hit)
        assert r.evicted_blocks == 0


def random_trace(rng: random.Random, trace_block: int) -> Trace:
    """A few prompts over a small tree of block ids (so prefixes are shared)."""
    paths = [[1, 2, 3], [1, 2, 4], [1, 5], [6, 7], [1, 2, 3, 8]]
    reqs = []
    for _ in range(rng.randrange(3, 7)):
        path = rng.choice(paths)[: rng.randrange(1, 5)]
        n = rng.randrange((len(path) - 1) * trace_block + 1, len(path) * trace_block + 1)
        reqs.append(LabRequest(0.0, n, 1, tuple(path)))  # ids of a tree path: already nodes
    return Trace("random", "test", trace_block, reqs, 0)


def brute_force_best(trace: Trace, block_size: int, pool_blocks: int) -> int:
    """Most prefix-hit tokens any cache of pool_blocks blocks could get: every choice of what
    to keep (bypass, or evict any block) at every miss."""
    refs = []
    for r in trace.requests:
        keys = trace.block_keys(r, block_size)
        fits = -(-r.input_length // block_size) <= pool_blocks
        hittable = (r.input_length - 1) // block_size if fits else 0
        refs.append([(k, i < hittable) for i, k in enumerate(keys)])
    flat = [(k, can_hit, i == 0) for req in refs for i, (k, can_hit) in enumerate(req)]

    @cache
    def best(pos: int, held: frozenset, prefix: bool) -> int:
        if pos == len(flat):
            return 0
        key, can_hit, first = flat[pos]
        prefix = prefix or first
        if key in held:
            return (prefix and can_hit) + best(pos + 1, held, prefix)
        options = [best(pos + 1, held, False)]  # bypass
        if len(held) < pool_blocks:
            options.append(best(pos + 1, held | {key}, False))
        else:
            options += [best(pos + 1, (held - {v}) | {key}, False) for v in held]
        return max(options)

    return best(0, frozenset(), True) * block_size


@pytest.mark.parametrize("trace_block", [1, 3])  # 3: segments of up to 3 blocks
def test_belady_equals_brute_force_on_small_random_traces(trace_block):
    rng = random.Random(trace_block)
    for _ in range(25):
        trace = random_trace(rng, trace_block)
        stream = ceilings.segment_stream(trace, 1)
        for size in (1, 2, 3, 4):
            want = brute_force_best(trace, 1, size)
            assert ceilings.belady(stream, size).hit_tokens == want, (trace.requests, size)


def write_bailian(path: Path, prompts: list[tuple[list[int], int]]) -> Path:
    with open(path, "w") as f:
        for i, (ids, n) in enumerate(prompts):
            f.write(json.dumps(dict(chat_id=i, parent_chat_id=-1, timestamp=float(i),
                                    input_length=n, output_length=4, turn=1,
                                    hash_ids=ids)) + "\n")
    return path


@pytest.mark.parametrize("policy, dead", [("fifo", 1), ("lru", 0)])
def test_evicted_chain_head_leaves_its_tail_dead_live_and_in_the_lab(tmp_path, policy, dead):
    """4 blocks; A = 2 full blocks + 1 token is cached, then B needs 3 blocks: the 2 free ones
    and one of A's. fifo evicts A's head (registered first): A's tail stays, unreachable; lru
    evicts A's tail (released first): nothing is dead."""
    rng = random.Random(0)
    a, b = [rng.randrange(1000) for _ in range(33)], [rng.randrange(1000) for _ in range(48)]
    mgr = KVCacheManager(4, BS, eviction_policy=policy)
    mgr.admit(1, a)
    mgr.free(1)
    mgr.admit(2, b)
    snap = mgr.snapshot()
    mask = dead_blocks_in_snapshot(snap, mgr.pool.chain_roots)
    assert mask.sum() == dead and (mask == dead_blocks_in_pool(mgr.pool)).all()
    if dead:
        (tail,) = mask.nonzero()[0]
        mgr.free(2)
        assert snap.state[tail] == 3 and mgr.admit(3, a) == 0  # cached, yet never hit
    trace = load_trace(write_bailian(tmp_path / "t.jsonl", [([1, 2, 3], 33), ([4, 5, 6], 48)]))
    probe = Residency(sample_every=1)
    whatif.replay(trace, 4, BS, policy, on_request=probe)
    assert probe.dead == [(0, 0), (1, dead)]


def test_bailian_ids_are_chained_by_the_lab(tmp_path):
    """Id 2 after 1, then after 3: not the same block (the trace's ids are not chained)."""
    trace = load_trace(write_bailian(tmp_path / "t.jsonl", [([1, 2, 9], 40), ([3, 2, 9], 40),
                                                              ([1, 2, 8], 40)]))
    assert trace.format == "bailian" and trace.num_unchained_ids == 1
    keys = [trace.block_keys(r, BS) for r in trace.requests]
    assert keys[0][1] != keys[1][1] and keys[0][:2] == keys[2][:2]
    assert whatif.replay(trace, 100, BS).hit_tokens == 32  # the third request: 2 blocks


@pytest.mark.parametrize("content, message", [
    ("not json\n", "not a Mooncake or Bailian trace"),
    ('{"timestamp": 0}\n', "line 1 has no 'hash_ids'"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"x": 1}\n',
     ":2: not a mooncake trace line"),
])
def test_bad_traces_are_named(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(TraceError, match=message):
        load_trace(path)


def test_block_size_must_divide_the_trace_block(trace):
    with pytest.raises(TraceError, match="block size 48 must divide"):
        whatif.block_hashes(trace, 48)


def test_lab_command_prints_rows_and_writes_csv_and_png(tmp_path, capsys):
    from kvscope.app.cli import main as cli

    out_csv, out_png = tmp_path / "lab.csv", tmp_path / "lab.png"
    assert cli.main(["lab", str(HEAD), "--pool-blocks", "2000", "8000", "--policy", "lru",
                     "fifo", "belady", "--csv", str(out_csv), "--png", str(out_png)]) == 0
    printed = capsys.readouterr().out
    rows = [line.split(",") for line in out_csv.read_text().splitlines()]
    assert rows[0] == ["policy", "pool_blocks", "block_size", "mode", "token_hit_ratio",
                       "request_hit_ratio", "evicted_blocks", "groups"]
    assert {r[-1] for r in rows[1:]} == {"full"}
    assert "KV-cache groups: full attention (full)" in printed
    assert [(r[0], r[1]) for r in rows[1:-1]] == [
        (p, n) for p in ("lru", "fifo", "belady") for n in ("2000", "8000")]
    assert rows[-1][0] == "infinite" and len(printed.splitlines()) >= len(rows) + 1
    for size, row in zip((2000, 8000), rows[1:3], strict=True):
        assert abs(float(row[4]) - plain_lru_hit_ratio(HEAD, size)) < 0.005
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["lab", "missing.jsonl"], "no such file"),
    (["lab", str(HEAD), "--block-size", "48"], "must divide"),
    (["lab", str(HEAD), "--mode", "timed", "--residency"], "needs --mode sequential"),
])
def test_lab_command_errors_are_one_line_with_exit_2(argv, message, capsys):
    from kvscope.app.cli import main as cli

    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_an_sqlite_file_that_is_no_session_is_refused_clearly(tmp_path, capsys):
    import sqlite3

    from kvscope.app.cli import main as cli

    path = tmp_path / "s.kvscope"
    sqlite3.connect(path).execute("create table t (x)").connection.close()
    assert cli.main(["lab", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and len(err.strip().splitlines()) == 1


def test_residency_lifetime_idle_and_reuse_gap_on_a_hand_made_trace(tmp_path):
    """4 blocks, lru. r0: A (2 full blocks + 1 token); r1: B (3 blocks) evicts A's tail;
    r2: A again hits A's head and evicts B's tail and middle; r3: C (4 blocks) evicts B's head
    (stored r1), A's new tail (stored r2) and A's head (stored r0, last hit r2)."""
    from kvscope.lab.residency import reuse_gaps

    trace = load_trace(write_bailian(tmp_path / "t.jsonl", [
        ([1, 2, 3], 33), ([4, 5, 6], 48), ([1, 2, 3], 33), ([7, 8, 9, 10], 64)]))
    probe = Residency()
    r = whatif.replay(trace, 4, BS, "lru", on_request=probe)
    assert r.hit_tokens == BS
    assert sorted(probe.lifetime) == [1, 1, 1, 1, 2, 3]
    assert sorted(probe.idle_before_evict) == [1, 1, 1, 1, 1, 2]
    gaps = reuse_gaps(ceilings.segment_stream(trace, BS))
    assert gaps.gaps.tolist() == [2, 2] and gaps.percentile(90) == 2


@pytest.mark.parametrize("policy, dead", [("fifo", [1]), ("lru", [])])
def test_the_live_engine_reports_the_same_dead_tail(policy, dead):
    """The scenario above in the real engine (demo model): A (33 tokens + 1 sampled) is cached
    in blocks 0-1, then B (47 + 1) takes 3 of the 4 blocks; the window outlines what
    `Engine.dead_blocks` returns."""
    from kvscope.engine import Engine
    from kvscope.engine.config import EngineConfig, SamplingParams

    engine = Engine.from_pretrained("demo", EngineConfig(num_blocks=4, block_size=BS,
                                                         eviction_policy=policy))
    rng = random.Random(0)
    a, b = [rng.randrange(100, 1000) for _ in range(33)], [rng.randrange(100, 1000)
                                                           for _ in range(47)]
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for prompt in (a, b):
        engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
    assert engine.dead_blocks().tolist() == dead
    snap = engine.snapshot()
    assert dead_blocks_in_snapshot(snap, engine.manager.pool.chain_roots).nonzero()[0].tolist() \
        == dead
    if dead:
        assert snap.state[1] == 3  # cached, yet A asked again hits nothing
        rid = engine.add_request(a, params)
        done = []
        while engine.has_unfinished():
            done += [o for o in engine.step() if o.request_id == rid and o.finished]
        assert done[0].num_cached_tokens == 0
