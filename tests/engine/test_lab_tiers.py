"""The lab's two tiers: what-if replays through the manager's host tier (engine/host_tier.py) on
hand-made traces with numbers worked out by hand from its rules, and against an independent
plain-dict two-level LRU on the Mooncake conversation trace (the head here; the whole trace
when the shared data folder has it)."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import pytest

from kvscope.engine import events as ev
from kvscope.lab import report, tiers, whatif
from kvscope.lab.traces import LabRequest, Trace, load_trace

HEAD = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_head200.jsonl"
FULL = Path("/work/shared/data/mooncake/conversation_trace.jsonl")
BS = 16


def hand_trace(*prompts: tuple[tuple[int, ...], int]) -> Trace:
    """Prompts as (chain nodes, tokens) at one 16-token trace block per kvscope block: node i of
    a prompt is its block i (a tree path, so equal nodes mean equal prefixes)."""
    return Trace("hand", "test", BS, [LabRequest(float(i), n, 1, nodes)
                                      for i, (nodes, n) in enumerate(prompts)], 0)


A, B, C = (1, 2, 3), (4, 5, 6), (7, 8, 9)


def test_evict_to_host_then_hit_from_host():
    """4 device blocks, 4 host blocks, block 16. r0: A = 2 full blocks + 1 token: freed tail
    first, the device queues [A2, A1]. r1: B = 3 full blocks takes the 2 free blocks and evicts
    A2 (offloaded 1); queue [A1, B3, B2, B1]. r2: A hits A1 on the device and A2 on the host
    (16 + 16 tokens); loading A2 and A's partial block evict B3 and B2 (offloaded 3, loaded 1).
    r3: B hits B1 on the device and B2 on the host (loaded 2); its last block evicts the
    device's copy of A2, which the host holds already (not offloaded again)."""
    r = whatif.replay(hand_trace((A, 33), (B, 48), (A, 33), (B, 48)), 4, BS, host_blocks=4)
    assert (r.device_hit_tokens, r.host_hit_tokens, r.query_tokens) == (32, 32, 162)
    assert (r.offloaded_blocks, r.loaded_blocks, r.host_evicted_blocks) == (3, 2, 0)
    assert r.evicted_blocks == 4 and r.num_requests_hit == 2
    assert r.host_hit_ratio == pytest.approx(32 / 162)
    without = whatif.replay(hand_trace((A, 33), (B, 48), (A, 33), (B, 48)), 4, BS)
    assert (without.hit_tokens, without.host_hit_tokens, without.offloaded_blocks) == (32, 0, 0)


def test_a_hybrid_model_loads_all_of_full_attention_and_only_the_window_from_the_host():
    """Prompts A, B, A of 5 blocks (80 tokens); full attention + a 32-token window. A 12-block
    pool holds one prompt's blocks in both groups: B evicts A to the host, and A's second time
    hits its 4 whole blocks (64 tokens, the last token computed) from the host: the full group
    loads 4 blocks, the window group the 2 its window needs at the hit's end."""
    from kvscope.engine.kv_groups import KVGroup

    groups = (KVGroup(), KVGroup(window=32, layers=(1,)))
    a, b = (1, 2, 3, 4, 5), (6, 7, 8, 9, 10)
    trace = Trace("t", "test", 16, [LabRequest(i, 80, 1, n) for i, n in enumerate((a, b, a))],
                  0, groups)
    cold = whatif.replay(trace, 12, 16, groups=groups)
    assert cold.hit_tokens == 0
    tiered = whatif.replay(trace, 12, 16, groups=groups, host_blocks=16)
    assert (tiered.hit_tokens, tiered.host_hit_tokens, tiered.loaded_blocks) == (64, 64, 6)
    assert tiered.host_evicted_blocks == 0
    roomy = whatif.replay(trace, 20, 16, groups=groups, host_blocks=16)
    assert (roomy.hit_tokens, roomy.host_hit_tokens, roomy.loaded_blocks) == (64, 0, 0)


def test_host_eviction_keeps_the_last_evicted_and_evicts_tails_first():
    """4 device blocks, 1 host block. r0: A (33 tokens): the device queues [A2, A1]. r1: B
    evicts A2 to the host. r2: C (48 tokens) evicts A1, B3, B2 at once: the host holds one,
    the last evicted (B2), evicting A2 (host evicted 1). r3: B hits B1 on the device and B2 on
    the host (held through r3: what its blocks evict from the device, C3 and C2, finds no host
    block to go to). r4: A misses both tiers (A1 was never kept); its 3 blocks evict C1, B3 and
    B2 from the device: B2 the host holds already, of C1 and B3 it takes the last, B3, evicting
    B2 (host evicted 2)."""
    trace = hand_trace((A, 33), (B, 48), (C, 48), (B, 48), (A, 33))
    r = whatif.replay(trace, 4, BS, host_blocks=1)
    assert (r.device_hit_tokens, r.host_hit_tokens) == (16, 16)
    assert (r.offloaded_blocks, r.loaded_blocks, r.host_evicted_blocks) == (3, 1, 2)


def test_a_chain_evicted_at_once_keeps_its_head_on_a_small_host():
    """4 device blocks, 2 host blocks. r0: A = 4 full blocks + 1 token: the device queues
    [A4, A3, A2, A1]. r1: D = 5 blocks evicts all four at once; the host keeps the last two
    evicted, A2 and A1, the chain's head. r2: A hits A1 and A2 on the host (32 tokens), which
    a host keeping A4 and A3 (reachable from nothing) would not; both host blocks are held
    through r2, so the 5 device blocks its loads and its rest evict are not offloaded."""
    trace = hand_trace(((1, 2, 3, 4, 5), 65), ((6, 7, 8, 9, 10), 80), ((1, 2, 3, 4, 5), 65))
    r = whatif.replay(trace, 5, BS, host_blocks=2)
    assert (r.device_hit_tokens, r.host_hit_tokens) == (0, 32)
    assert (r.offloaded_blocks, r.loaded_blocks, r.host_evicted_blocks) == (2, 2, 0)
    assert r.evicted_blocks == 9


def plain_two_level(path: Path, device: int, host: int, block_size: int = BS,
                    trace_block: int = 512, limit: int | None = None) -> tuple[float, float]:
    """(device, host) token hit ratios of a two-level LRU written the plain way: a device LRU of
    `device` blocks; a block evicted from it goes to a host LRU of `host` blocks (if not there
    already); a lookup takes the longest prefix found on the device, then goes on in the host,
    whose hits are copied back to the device (the host copy stays and becomes the host's most
    recent). Prompts only, full blocks only, the last prompt token left to compute, a prompt
    larger than the device pool a miss; after a request its blocks are the device's most
    recent, head last (the manager frees tail first), so the device evicts a chain's tail
    first and the host receives them in that order."""
    dev: OrderedDict = OrderedDict()
    hst: OrderedDict = OrderedDict()
    hit_d = hit_h = query = 0
    with open(path) as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            r = json.loads(line)
            n, ids = r["input_length"], r["hash_ids"]
            query += n
            if -(-n // block_size) > device:
                continue
            keys = [(tuple(ids[: k * block_size // trace_block + 1]), k * block_size % trace_block)
                    for k in range(n // block_size)]
            wanted = keys[: (n - 1) // block_size]
            d = 0
            while d < len(wanted) and wanted[d] in dev:
                d += 1
            h = d
            while h < len(wanted) and wanted[h] in hst:
                hst.move_to_end(wanted[h])
                h += 1
            hit_d += d * block_size
            hit_h += (h - d) * block_size
            for k in reversed(keys):
                dev[k] = None
                dev.move_to_end(k)
            while len(dev) > device:
                k, _ = dev.popitem(last=False)
                if k not in hst:
                    hst[k] = None
                    if len(hst) > host:
                        hst.popitem(last=False)
    return hit_d / query, hit_h / query


def check_against_plain(path: Path, pairs: list[tuple[int, int]], limit: int | None = None
                        ) -> list[whatif.WhatIfResult]:
    """The lab's replay at each (device, host) pair within 0.5 pp of the plain two-level LRU,
    tier by tier."""
    trace = load_trace(path, limit=limit)
    hashes = whatif.block_hashes(trace, BS)
    results = []
    for device, host in pairs:
        r = whatif.replay(trace, device, BS, hashes=hashes, host_blocks=host)
        want_d, want_h = plain_two_level(path, device, host, limit=limit)
        assert abs(r.device_hit_ratio - want_d) < 0.005, (device, host, r, want_d)
        assert abs(r.host_hit_ratio - want_h) < 0.005, (device, host, r, want_h)
        results.append(r)
    return results


# The head's reuse is either near or very far: host tiers matter only at large sizes there.
HEAD_PAIRS = [(300, 8_000), (500, 30_000), (1_000, 60_000), (2_000, 512)]


def test_two_tiers_agree_with_a_plain_two_level_lru_on_the_mooncake_head():
    results = check_against_plain(HEAD, HEAD_PAIRS)
    assert results[2].host_hit_ratio > 0.01  # the host tier matters at a pair checked


@pytest.mark.skipif(not FULL.is_file(),
                    reason=f"the whole Mooncake conversation trace is not at {FULL} (the shared "
                    "data folder of this machine); the head above is checked from the repo")
def test_two_tiers_agree_with_a_plain_two_level_lru_on_the_whole_mooncake_trace():
    """Its first 2,000 requests (a few seconds; the whole trace's pairs, tens of seconds each,
    are in the issue's notes)."""
    (r,) = check_against_plain(FULL, [(500, 20_000)], limit=2_000)
    assert r.host_hit_ratio > 0.005


def test_report_rows_carry_the_tiers_and_the_sizing_line(tmp_path):
    trace = load_trace(HEAD)
    rows, _ = report.run(trace, [1_000], ["lru", "belady"], BS, host_sizes=(4_000, 60_000),
                         on_row=lambda r: None)
    assert [(r.policy, r.host_blocks) for r in rows] == [
        ("lru", 0), ("lru", 4_000), ("lru", 60_000), ("belady", 0), ("infinite", 0)]
    base, _, big = rows[:3]
    assert big.no_host_hit_ratio == base.token_hit_ratio
    assert big.device_hit_ratio == pytest.approx(base.token_hit_ratio)
    assert big.token_hit_ratio == pytest.approx(base.token_hit_ratio + big.host_hit_ratio)
    assert tiers.sizing_line(big) == (
        f"a 60x host tier (60,000 blocks, lru) turns {100 * base.token_hit_ratio:.1f} % hits "
        f"into {100 * big.token_hit_ratio:.1f} % ({100 * big.host_hit_ratio:.1f} % from the "
        "host; lru device pool of 1,000 blocks)")
    assert tiers.sizing_line(big, 2 ** 20).startswith(
        "a 60x host tier (60,000 blocks, 58.59 GiB, lru)")
    out = tmp_path / "lab.csv"
    report.write_csv(out, rows, 2 ** 20)
    lines = out.read_text().splitlines()
    assert lines[0].split(",") == [*report.CSV_COLUMNS, *report.TIER_COLUMNS]
    moved = (big.offloaded_blocks + big.loaded_blocks) * 2 ** 20
    assert f",{moved},{base.token_hit_ratio:.6f}," in lines[3]


def test_the_curve_per_tier_replays_each_host_size_over_device_sizes():
    trace = load_trace(HEAD, limit=60)
    rows = report.tier_curve(trace, BS, [300], [20_000], points=3)
    sizes = sorted({r.pool_blocks for r in rows})
    assert 300 in sizes and len(rows) == 2 * len(sizes)
    for size in sizes:
        (no_host,) = [r for r in rows if r.pool_blocks == size and not r.host_blocks]
        (host,) = [r for r in rows if r.pool_blocks == size and r.host_blocks]
        assert host.no_host_hit_ratio == no_host.token_hit_ratio
        assert host.device_hit_ratio == pytest.approx(no_host.token_hit_ratio)


@pytest.mark.parametrize("text, per_block, want", [
    ("8000", None, [8000]), ("8000, 32000", None, [8000, 32000]),
    ("1GiB,0.5gib", 2 ** 20, [1024, 512])])
def test_host_sizes(text, per_block, want):
    assert tiers.parse_host_sizes(text, per_block) == want


def test_the_lab_command_prints_tiers_and_writes_their_csv_and_png(tmp_path, capsys):
    from kvscope.app.cli import main as cli

    out_csv, out_png = tmp_path / "lab.csv", tmp_path / "lab.png"
    assert cli.main(["lab", str(HEAD), "--limit", "40", "--pool-blocks", "1000",
                     "--host-blocks", "4000,30000", "--policy", "lru", "--csv", str(out_csv),
                     "--png", str(out_png)]) == 0
    printed = capsys.readouterr().out
    assert "host tiers: 4,000, 30,000 blocks (lru); blocks moved (no --kv-bytes-per-token: " \
           "blocks only)" in printed
    assert "a 4x host tier (4,000 blocks, lru) turns" in printed
    assert "a 30x host tier (30,000 blocks, lru) turns" in printed
    header = out_csv.read_text().splitlines()[0].split(",")
    assert header[-1] == "sizing" and header[len(report.CSV_COLUMNS)] == "host_blocks"
    curve = (tmp_path / "lab-tiers.csv").read_text().splitlines()
    assert {line.split(",")[8] for line in curve[1:]} == {"0", "4000", "30000"}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_step_by_step_replay_with_a_host_tier_from_any_checkpoint():
    """lab.replay's viewer pass with a host tier: its hits, offloads and loads are
    whatif.replay's, and any step from a checkpoint (its host pool cloned) gives the events a
    replay from the start gives (host block ids included)."""
    from kvscope.lab.replay import WhatIfReplay

    trace = load_trace(HEAD)
    passes = []
    for every in (10**6, 7):
        replay = WhatIfReplay(trace, 300, BS, host_blocks=8_000)
        replay.checkpoint_every = every
        assert replay.run()
        passes.append(replay)
    sparse, dense = passes
    whole = whatif.replay(trace, 300, BS, host_blocks=8_000)
    assert sum(dense.cached.values()) == whole.hit_tokens
    assert sum(r.offloaded_blocks for r in dense.records) == whole.offloaded_blocks > 0
    assert sum(r.loaded_blocks for r in dense.records) == whole.loaded_blocks > 0
    loads = [i for i, r in enumerate(dense.records) if r.loaded_blocks]
    for step in [199, 0, 100, 101, 33, *loads[:3]]:
        a, b = sparse.state_at(step), dense.state_at(step)
        assert [(e.kind, e.blocks) for e in a.events] == [(e.kind, e.blocks) for e in b.events]
        assert (ev.LOADED in {e.kind for e in b.events}) == (step in loads)
