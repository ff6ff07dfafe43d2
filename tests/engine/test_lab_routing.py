"""The routing what-if (kvscope.lab.routing) on a slice of the real Mooncake conversation trace
against an independent plain simulation (plain_routing.py), one replica against the single-pool
lab, the load cap, timed mode's loads, and the command line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from plain_routing import plain_routed_hit_ratio

from kvscope.engine.kv_groups import KVGroup
from kvscope.lab import routing, whatif
from kvscope.lab.traces import LabRequest, Trace, load_trace

DATA = Path(__file__).resolve().parents[1] / "data"
SLICE = DATA / "mooncake_conversation_head800.jsonl"
ROUTERS = ["round-robin", "random", "least-loaded", "hash:64", "hash:1", "prefix-aware"]
BS = 16


@pytest.fixture(scope="module")
def trace():
    return load_trace(SLICE)


@pytest.fixture(scope="module")
def hashes(trace):
    return whatif.block_hashes(trace, BS)


@pytest.fixture(scope="module")
def head():
    """The first 300 requests (the single-pool comparisons: hits, evictions and waits)."""
    return load_trace(SLICE, limit=300)


@pytest.mark.parametrize("router, replicas, size", [
    *((router, 4, 30_000) for router in ROUTERS),
    ("round-robin", 2, 100_000), ("prefix-aware", 2, 100_000)])
def test_routed_hit_ratio_matches_a_plain_simulation(trace, hashes, router, replicas, size):
    want, sent = plain_routed_hit_ratio(SLICE, router, replicas, size)
    got = routing.route(trace, router, replicas, size, BS, hashes=hashes)
    assert abs(got.token_hit_ratio - want) < 0.005, (got.token_hit_ratio, want)
    assert [r.num_requests for r in got.replicas] == sent


def test_routers_differ_on_the_slice(trace, hashes):
    """Not a vacuous check: at 2 x 100,000 blocks the routers' hit ratios spread by pp, and
    hash on one block sends everything to one replica (the trace's shared first block)."""
    got = {r: routing.route(trace, r, 2, 100_000, BS, hashes=hashes)
           for r in ("round-robin", "hash:1", "prefix-aware")}
    ratios = {r: g.token_hit_ratio for r, g in got.items()}
    assert ratios["prefix-aware"] - ratios["round-robin"] > 0.03, ratios
    assert sorted(x.num_requests for x in got["hash:1"].replicas) == [0, 800]


@pytest.mark.parametrize("mode", whatif.MODES)
@pytest.mark.parametrize("router", ROUTERS)
def test_one_replica_is_the_single_pool_lab_exactly(head, router, mode):
    groups = (KVGroup(), KVGroup(window=1024)) if router == "hash:64" else None
    hashes = whatif.block_hashes(head, BS)
    one = whatif.replay(head, 20_000, BS, "lru", mode, 0.03, hashes, groups=groups,
                        prefill_s=1e-4)
    got = routing.route(head, router, 1, 20_000, BS, "lru", mode, 0.03, 1e-4, hashes,
                        groups=groups)
    (r,) = got.replicas
    assert {**vars(r), "wall_s": 0} == {**vars(one), "wall_s": 0}
    assert got.token_hit_ratio == one.token_hit_ratio and one.hit_tokens > 0


@pytest.mark.parametrize("cap", [1.0, 1.25, 2.0])
def test_prefix_aware_keeps_every_replica_under_the_load_cap(trace, hashes, cap):
    got = routing.route(trace, "prefix-aware", 4, 30_000, BS, hashes=hashes, load_cap=cap)
    sent = [r.num_requests for r in got.replicas]
    assert max(sent) <= math.ceil(cap * len(trace.requests) / 4), sent


def conversations(turns: int, chats: int, block: int = 32) -> Trace:
    """`chats` conversations of `turns` turns, interleaved: turn t of chat c has t + 1 trace
    blocks, its first t those of turn t - 1 (as a multi-turn trace)."""
    node = iter(range(1 << 30))
    paths = [[next(node)] for _ in range(chats)]
    reqs = []
    for _ in range(turns):
        for path in paths:
            reqs.append(LabRequest(float(len(reqs)), len(path) * block, 1, tuple(path)))
            path.append(next(node))
    return Trace("chats", "test", block, reqs, 0)


def test_prefix_aware_follows_the_conversation_and_round_robin_does_not():
    """3 chats of 4 turns on 2 replicas: prefix-aware hits every earlier turn (as one big pool
    would); round-robin alternates, so a chat's turns land on both replicas."""
    trace = conversations(4, 3)
    infinite = whatif.replay(trace, 10_000, BS).hit_tokens
    aware = routing.route(trace, "prefix-aware", 2, 10_000, BS, load_cap=2.0)
    plain = routing.route(trace, "round-robin", 2, 10_000, BS)
    assert aware.hit_tokens == infinite > plain.hit_tokens


def timed_trace(first_output: int) -> Trace:
    """Request 0 at t=0 (1,024 prompt tokens, `first_output` output tokens), request 1 at t=0
    (short), request 2 at t=1 s."""
    return Trace("timed", "test", 16, [LabRequest(0.0, 1024, first_output, tuple(range(64))),
                                       LabRequest(0.0, 32, 1, (100, 101)),
                                       LabRequest(1.0, 32, 1, (200, 201))], 0)


@pytest.mark.parametrize("first_output, prefill_s, busy", [
    (1, 0.0, False),  # request 0 finished at 0.03 s: both idle at t=1, the tie goes to 0
    (100, 0.0, True),  # held 3 s: replica 0 is busy at t=1
    (1, 0.002, True),  # 1,024 prompt tokens at 2 ms each: held 2 s
])
def test_timed_least_loaded_sees_what_each_replica_holds(first_output, prefill_s, busy):
    got = routing.route(timed_trace(first_output), "least-loaded", 2, 1_000, BS, mode="timed",
                        prefill_s=prefill_s)
    assert [r.num_requests for r in got.replicas] == ([1, 2] if busy else [2, 1])


@pytest.mark.parametrize("text, message", [
    ("round-robin,bogus", "'bogus' is not a router"),
    ("hash", "'hash' is not a router"),
    ("hash:0", "'hash:0' is not a router"),
    ("random,random", "'random' is there twice"),
])
def test_bad_router_lists_are_named(text, message):
    with pytest.raises(ValueError, match=message):
        routing.parse_routers(text)


def test_lab_command_routes_and_writes_the_table(tmp_path, capsys):
    from kvscope.app.cli import main as cli

    out = tmp_path / "routing.csv"
    assert cli.main(["lab", str(SLICE), "--limit", "200", "--replicas", "2", "--pool-blocks",
                     "50000", "--router", "round-robin,prefix-aware", "--csv", str(out)]) == 0
    printed = capsys.readouterr().out
    want, _ = plain_routed_hit_ratio(SLICE, "prefix-aware", 2, 50_000, limit=200)
    assert f"prefix-aware: {100 * want:.1f} % vs round-robin" in printed
    rows = [line.split(",") for line in out.read_text().splitlines()]
    assert rows[0] == list(routing.CSV_COLUMNS)
    assert [(r[3], r[4]) for r in rows[1:]] == [
        (router, j) for router in ("round-robin", "prefix-aware") for j in ("fleet", "0", "1")]
    assert sum(int(r[8]) for r in rows[2:4]) == int(rows[1][8]) == 200
    curve = [line.split(",") for line in
             (tmp_path / "routing-routing-curve.csv").read_text().splitlines()]
    assert {r[0] for r in curve[1:]} == {"round-robin", "prefix-aware", "one pool"}


@pytest.mark.parametrize("argv, message", [
    (["--replicas", "0"], "--replicas must be at least 1"),
    (["--router", "random"], "--router needs --replicas"),
    (["--replicas", "2", "--router", "nearest"], "--router: 'nearest' is not a router"),
    (["--replicas", "2", "--load-cap", "0.5"], "--load-cap must be >= 1"),
    (["--replicas", "2", "--host-blocks", "100"], "--host-blocks with --replicas"),
    (["--replicas", "2", "--policy", "belady"], "routing needs an eviction policy"),
    (["--mode", "timed", "--prefill-ms-per-token", "-1"], "--prefill-ms-per-token must be"),
])
def test_lab_routing_errors_are_one_line_with_exit_2(argv, message, capsys):
    from kvscope.app.cli import main as cli

    assert cli.main(["lab", str(SLICE), "--limit", "20", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
