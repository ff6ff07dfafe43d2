"""The cache lab with KV-cache groups (a hybrid model's full-attention and sliding-window layers
sharing one pool): hits written by hand from vLLM's rules (a hit is the length every group
accepts; a window of W tokens needs only the cdiv(W - 1, block size) blocks before the hit point),
the timed mode's never-fits rule, the curve per group config, the `--groups` syntax, and the
CLI naming the groups. (tests/conformance/test_groups_vs_vllm.py checks the lab's hybrid
replay of the Mooncake trace against vLLM's own KVCacheManager.)"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from kvscope.engine.explain import WINDOW_CUT
from kvscope.engine.kv_groups import KVGroup
from kvscope.lab import ceilings, report, whatif
from kvscope.lab.replay import WhatIfReplay
from kvscope.lab.traces import LabRequest, Trace, load_trace

HEAD = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_head200.jsonl"
BS = 16
HYBRID = (KVGroup(), KVGroup(window=32))  # the window needs cdiv(31, 16) = 2 blocks


def hand_trace(prompts) -> Trace:
    """Prompts as (trace block ids, tokens), 16 tokens a trace block; equal id runs from the
    start are equal prefixes."""
    node_of: dict[tuple, int] = {}
    requests = []
    for ids, n in prompts:
        nodes, node = [], -1
        for h in ids:
            node = node_of.setdefault((node, h), len(node_of))
            nodes.append(node)
        requests.append(LabRequest(0.0, n, 4, tuple(nodes)))
    return Trace("hand", "test", BS, requests, 0)


# A pool of 12 blocks; each request is admitted, then freed (group 0's table tail first, then
# group 1's), blocks handed out lowest first, then in LRU order.
SCENARIO = hand_trace([
    ([1, 2, 3, 4, 5], 80),  # r0: 5 blocks in each group (0-4 full, 5-9 window), all cached
    ([1, 2, 3, 4, 6], 80),  # r1: full hits ids 1-4; the window needs only ids 3, 4 (blocks 7,
    #   8): hit 64. The window's ids 1, 2 (blocks 5, 6) are not taken: LRU keeps them oldest.
    ([20, 21], 32),  # r2: a miss; 2 blocks a group evict 4, 9 (the ids 5), then 6, 5
    ([1, 2, 3, 4, 9], 80),  # r3: full hits ids 1-4; the window has ids 3, 4 but no longer 1,
    #   2: it needs only the 2 blocks before the hit point: hit 64 (evicts r1's two id-6 blocks)
    ([1, 2, 10], 40),  # r4: full has ids 1, 2; the window has neither: hit 0 (a window cut)
])


def test_hand_computed_hits_of_a_hybrid_pool():
    r = whatif.replay(SCENARIO, 12, BS, groups=HYBRID)
    assert (r.hit_tokens, r.num_requests_hit, r.num_rejected) == (128, 2, 0)
    assert r.evicted_blocks == 4 + 2 + 6  # r2; r3; r4 (3 fresh blocks in each group)
    assert r.groups == HYBRID
    # one full-attention group: the same pool keeps ids 1, 2 for r4 (and evicts nothing)
    full = whatif.replay(SCENARIO, 12, BS)
    assert (full.hit_tokens, full.evicted_blocks) == (64 + 64 + 32, 0)
    # the step-by-step replay: the same hits request by request, and r4 explained
    steps = WhatIfReplay(SCENARIO, 12, BS, groups=HYBRID)
    steps.run()
    assert [rec.hit_tokens for rec in steps.records] == [0, 64, 0, 64, 0]
    why = steps.explanation(4, 4)
    assert (why.reason, why.cut_by_group, why.reach_blocks, why.group_blocks_found) == \
        (WINDOW_CUT, "sliding window 32", 2, 0)
    assert steps.state_at(1).snapshot.groups == HYBRID


def test_a_window_wider_than_the_prompts_needs_every_block_before_the_hit():
    """window 1000 would need cdiv(999, 16) = 63 blocks: no prompt here has them, so the group
    hits the run of its cached blocks from the start, as full attention, and takes them all
    (none is before its window). r1 hits 64 and refreshes ids 1-4 in both groups (LRU after it:
    4, 9, 10, 3, 2, 1, 0, 11, 8, 7, 6, 5), so r2's 4 blocks evict blocks 4, 9, 10 and 3, group
    0's id 4 among them: r3 hits ids 1-3 (48; the window group still has id 4, but no group may
    lengthen a hit) and r4 ids 1, 2 (32)."""
    r = whatif.replay(SCENARIO, 12, BS, groups=(KVGroup(), KVGroup(window=1000)))
    assert (r.hit_tokens, r.num_requests_hit) == (64 + 48 + 32, 3)


@pytest.mark.parametrize("pool, rejected", [(10, 1), (11, 0)])
def test_timed_mode_rejects_only_what_never_fits(pool, rejected):
    """64 prompt + 48 output tokens, full + window 16: the prompt takes 4 blocks a group (8);
    then the window lets go of the blocks before it (skipped tokens 64 - 16 + 1 = 49: 3 blocks)
    and the output needs 7 blocks a group: 7 + 4 = 11 at the peak."""
    trace = Trace("t", "test", BS, [LabRequest(0.0, 64, 48, (0, 1, 2, 3))], 0)
    r = whatif.replay(trace, pool, BS, mode="timed", groups=(KVGroup(), KVGroup(window=16)))
    assert r.num_rejected == rejected
    assert whatif.replay(trace, 7, BS, mode="timed").num_rejected == 0  # one group: 7 blocks


def test_the_curve_runs_with_the_groups():
    trace = load_trace(HEAD, limit=30)
    stream = ceilings.segment_stream(trace, BS)
    groups = (KVGroup(), KVGroup(window=1024))
    sizes = [300, 1200]
    curve = dict(report.lru_curve(stream, sizes, trace=trace, groups=groups))
    assert len(curve) <= report.GROUPS_CURVE_POINTS + len(sizes)
    for size in sizes:
        r = whatif.replay(trace, size, BS, groups=groups)
        assert curve[size] == r.token_hit_ratio
    one = dict(report.lru_curve(stream, sizes))
    assert curve[1200] < one[1200]  # the window group shares the pool: fewer hits
    # the infinite cache: every group has every block it needs (twice the blocks held)
    rows, _ = report.run(trace, [10**6], ["lru"], on_row=lambda r: None, groups=groups)
    assert rows[0].token_hit_ratio == rows[1].token_hit_ratio
    assert rows[1].pool_blocks == 2 * ceilings.distinct_blocks(stream)
    assert {r.groups for r in rows} == {"full,window:1024"}


@pytest.mark.parametrize("text, groups", [
    ("full", (KVGroup(),)), ("full,window:1024", (KVGroup(), KVGroup(window=1024))),
    (" window:4096 ", (KVGroup(window=4096),)),
    ("full, window:512,window:4096", (KVGroup(), KVGroup(window=512), KVGroup(window=4096)))])
def test_groups_syntax(text, groups):
    assert whatif.parse_groups(text) == groups
    assert whatif.parse_groups(whatif.groups_spec(groups)) == groups


def test_the_lab_command_names_the_groups(tmp_path, capsys):
    from kvscope.app.cli import main as cli

    out_csv = tmp_path / "lab.csv"
    assert cli.main(["lab", str(HEAD), "--limit", "30", "--groups", "full,window:1024",
                     "--pool-blocks", "1200", "--csv", str(out_csv)]) == 0
    printed = capsys.readouterr().out
    assert "KV-cache groups: full attention + sliding window 1024 (full,window:1024); " \
           "belady is the full-attention group's ceiling" in printed
    with open(out_csv, newline="") as f:
        rows = list(csv.reader(f))
    by_policy = {r[0]: r for r in rows[1:]}
    assert by_policy["lru"][-1] == "full,window:1024" and by_policy["belady"][-1] == "full"
    want = whatif.replay(load_trace(HEAD, limit=30), 1200, BS,
                         groups=(KVGroup(), KVGroup(window=1024))).token_hit_ratio
    assert float(by_policy["lru"][4]) == pytest.approx(want, abs=1e-6)
    assert float(by_policy["lru"][4]) <= float(by_policy["belady"][4])
