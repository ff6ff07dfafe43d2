"""Attach keys the mirror by vLLM's KV group (`group_idx`) and learns each group's spec
(`kv_cache_spec_kind`, `kv_cache_spec_sliding_window`) from its stores; the hash slots carry the
groups into snapshots (`Snapshot.groups`, `Snapshot.block_group`) and recordings; our publisher
names the groups of a hybrid engine as vLLM 0.33 does."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch
from kv_fake_publisher import FakePublisher, batch, removed, stored

from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.kv_groups import FULL, SLIDING, KVGroup, describe
from kvscope.engine.snapshot import FREE
from kvscope.sessions import SessionReader
from kvscope.sessions.kv_events import Attachment, KVEventPublisher, Mirror, decode_batch
from kvscope.sessions.kv_events.session import AttachSession
from kvscope.sessions.kv_events.slots import HashSlots, group_lines

HYBRID = (KVGroup(), KVGroup(8))  # what the fake server below describes


def two_group_batches(layout: str) -> list[bytes]:
    """A hybrid server (group 0 full attention, group 1 a window of 8 tokens) in one layout:
    the same hashes in both groups, a window block removed, a full block removed."""
    full = dict(group=0, kind=FULL, window=None, layout=layout)
    window = dict(group=1, kind=SLIDING, window=8, layout=layout)
    return [batch([stored([1, 2, 3], None, **full), stored([1, 2, 3], None, **window)],
                  layout=layout),
            batch([stored([4], 3, **full), stored([4], 3, **window),
                   removed([1], group=1, layout=layout)], layout=layout),
            batch([removed([2], group=1, layout=layout), removed([4], group=0, layout=layout)],
                  layout=layout)]


def resident(mirror: Mirror) -> dict[int, set]:
    return {g: set(mirror.tree(group=g)) for g in (0, 1)}


@pytest.mark.parametrize("layout", ["map", "array"])
def test_the_mirror_learns_each_groups_spec_and_keeps_their_blocks_apart(layout):
    m = Mirror()
    slots = HashSlots(m, num_slots=16)
    for payload in two_group_batches(layout):
        m.apply(decode_batch(payload))
    assert m.specs == {(0, 0): (FULL, None), (0, 1): (SLIDING, 8)}
    assert m.groups() == HYBRID
    assert resident(m) == {0: {1, 2, 3}, 1: {3, 4}}
    assert m.health.unknown_removes == 0 and m.health.spec_conflicts == 0
    summary = m.summary()
    assert "dp rank 0, KV group 0 (full attention), GPU: 3 blocks" in summary
    assert "dp rank 0, KV group 1 (sliding window 8), GPU: 2 blocks" in summary
    # the hash slots: one slot per resident key, each in its key's group
    slots.tick(0.0, 0.1)
    snap = slots.snapshot()
    assert snap.groups == HYBRID
    held = {s: slots.key_of["GPU"][s] for s in range(snap.num_blocks) if snap.state[s] != FREE}
    assert len(held) == 5
    assert {s: int(snap.block_group[s]) for s in held} == {s: k[1] for s, k in held.items()}
    assert group_lines(snap) == ["KV group 0: full attention · 3 resident blocks",
                                 "KV group 1: sliding window 8 · 2 resident blocks"]
    window_slot = slots.slot_of[(0, 1, "GPU", 4)]
    assert "KV group 1 (sliding window 8) · GPU" in slots.describe(window_slot)


def test_groups_the_engine_does_not_model_are_named_and_conflicts_reported():
    m = Mirror()
    m.apply(decode_batch(batch([
        stored([1], None, group=0, kind="mla_attention"),
        stored([2], None, group=2, kind="sliding_window_mla", window=128),  # group 1 unseen
        stored([3], None, group=3)])))  # no spec published (older vLLM, SGLang)
    groups = m.groups()
    assert [g.name for g in groups] == ["mla attention", "kind unknown",
                                        "sliding window mla 128", "kind unknown"]
    # how the engine would treat them is unchanged: full attention, or the published window
    assert [g.kind for g in groups] == [FULL, FULL, SLIDING, FULL]
    assert describe(groups).startswith("4 KV groups: mla attention, kind unknown, ")
    assert m.group_label(0, 3) == "KV group 3"  # nothing published: no kind claimed
    # stores of one group that disagree: counted and said, the latest kept, nothing crashes
    m.apply(decode_batch(batch([stored([5], None, group=2, kind=SLIDING, window=64)],
                               layout="array")))
    assert m.health.spec_conflicts == 1 and m.groups()[2] == KVGroup(64)
    assert any("KV group spec conflicts: 1" in line for line in m.health.lines())
    assert "a store names sliding window 64, an earlier one sliding window mla 128" in \
        m.health.notes[-1]


def wait_for(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_recording_of_a_hybrid_server_replays_its_groups(tmp_path):
    """Group 1 first appears after the recording started: the replay has it from that step."""
    path = tmp_path / "hybrid.kvscope"
    fake = FakePublisher()
    session = AttachSession(fake.endpoint, record=str(path), num_slots=32, tick_s=0.05).start()
    try:
        fake.wait_subscribed(timeout_s=10)
        fake.send(0, batch([stored([1, 2], None, group=0, kind=FULL)]))
        wait_for(lambda: session.recorder is not None and session.latest.num_cached_blocks)
        time.sleep(0.15)
        fake.send(1, batch([stored([7, 8, 9], None, group=1, kind="mla_attention")]))
        wait_for(lambda: session.latest.num_cached_blocks == 5)
        time.sleep(0.15)
        fake.send(2, batch([removed([8], group=1)]))
        wait_for(lambda: session.latest.num_cached_blocks == 4)
        time.sleep(0.15)
    finally:
        session.stop()
    fake.close()
    live = session.latest
    assert live.groups == (KVGroup(), KVGroup(spec_kind="mla_attention"))
    with SessionReader(path) as reader:
        first = reader.snapshot_at(reader.first_step)
        assert first.groups == (KVGroup(),)
        for step in range(reader.first_step, reader.last_step + 1):  # every step, in order
            snap = reader.snapshot_at(step)
            assert len(snap.groups) > int(snap.block_group.max())
        end = reader.snapshot_at(reader.last_step)
    assert end.groups == live.groups
    assert (end.block_group == live.block_group).all() and (end.state == live.state).all()


# ------------------------------------------------------------------ our own publisher
def engine_hashes(engine) -> Counter:
    """(group, short hash) -> blocks holding it, from the engine's own pool."""
    snap = engine.snapshot()
    return Counter((int(g), int(h)) for h, g in zip(snap.block_hash, snap.block_group,
                                                     strict=True) if h)


def mirror_hashes(mirror: Mirror) -> Counter:
    return Counter({(k[1], k[3]): refs for k, (refs, *_) in mirror.blocks.items()})


def test_our_hybrid_engine_publishes_its_groups(hybrid_model_dir):
    """Traffic with shared prefixes longer than the window on a small pool: the mirror holds,
    group by group, the hashes the engine's pool holds (copies counted)."""
    from kvscope.engine import Engine

    engine = Engine.from_pretrained(str(hybrid_model_dir), EngineConfig(
        block_size=4, num_blocks=36, max_num_seqs=6, max_num_batched_tokens=64))
    assert [g.window for g in engine.manager.groups] == [None, 6]
    pub = KVEventPublisher(engine, "tcp://127.0.0.1:*", replay="tcp://127.0.0.1:*")
    att = Attachment(pub.endpoint, pub.replay_endpoint, replay_timeout_s=5.0).start()
    try:
        rng = random.Random(1)
        prefixes = [[rng.randrange(3, 300) for _ in range(n)] for n in (14, 22)]
        params = SamplingParams(max_tokens=5, ignore_eos=True)
        for i in range(40):
            engine.add_request(rng.choice(prefixes) + [rng.randrange(3, 300)
                                                       for _ in range(rng.randrange(1, 9))],
                               params)
            if i % 3 == 2:
                engine.step()
        while engine.has_unfinished():
            engine.step()
        deadline = time.monotonic() + 10
        while att.last < pub.seq - 1 and time.monotonic() < deadline:
            att.poll(10)
        m = att.mirror
        assert m.specs == {(0, 0): (FULL, None), (0, 1): (SLIDING, 6)}
        ours = engine_hashes(engine)
        assert {g for g, _ in ours} == {0, 1}
        assert mirror_hashes(m) == ours
        assert m.num_removed > 20  # the pool evicted, in both groups
        assert {k[1] for k in m.blocks} == {0, 1}
        assert m.health.unknown_removes == 0 and m.health.orphans == 0
    finally:
        att.close()
        pub.close()


def test_kvscope_serve_on_a_hybrid_model_publishes_each_groups_hashes(hybrid_model_dir,
                                                                      tmp_path):
    """`kvscope serve --kv-events` in a process of its own; the same run again here gives the
    engine state the mirror must equal, group by group."""
    from kvscope.app.cli import common
    from kvscope.app.cli.main import build_parser
    from kvscope.lab.workload import load_workload
    from kvscope.lab.workload_run import WorkloadRunner

    rng = random.Random(3)
    prefixes = [[rng.randrange(3, 300) for _ in range(n)] for n in (18, 26, 10)]
    workload = tmp_path / "hybrid.jsonl"
    workload.write_text("".join(json.dumps({
        "prompt_ids": prefixes[i % 3] + [rng.randrange(3, 300)
                                         for _ in range(rng.randrange(1, 12))],
        "max_tokens": 6, "ignore_eos": True}) + "\n" for i in range(24)))
    argv = ["serve", "--kv-events", "tcp://127.0.0.1:*", "--kv-events-replay",
            "tcp://127.0.0.1:*", "--model", str(hybrid_model_dir), "--workload", str(workload),
            "--num-blocks", "40", "--block-size", "4", "--wait", "1",
            "--threads", str(torch.get_num_threads())]  # the same float sums as here
    proc = subprocess.Popen([sys.executable, "-m", "kvscope.app", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline() for _ in range(2)]
        assert lines[1].startswith("publishing KV events on "), (lines, proc.stderr.read())
        endpoint, replay = (w.rstrip(",") for w in lines[1].split()[4::3])
        att = Attachment(endpoint, replay, replay_timeout_s=5.0).start()
        while proc.poll() is None:
            att.poll(50)
        att.poll(200)
        out = proc.stdout.read()
    finally:
        proc.kill()
        proc.wait()
    att.close()
    assert proc.returncode == 0, proc.stderr.read()
    published = int(next(ln for ln in out.splitlines() if ln.startswith("published")).split()[1])
    assert att.last == published - 1 and att.health.lost == 0
    args = build_parser().parse_args(argv)
    args.threads = None  # this process keeps its threads (the same count)
    engine = common.load_engine(args)
    runner = WorkloadRunner(engine, load_workload(workload))
    while (wait := runner.advance()) is not None:
        time.sleep(wait)
    ours = engine_hashes(engine)
    assert {g for g, _ in ours} == {0, 1} and engine.snapshot().num_evicted_blocks > 50
    assert mirror_hashes(att.mirror) == ours
    assert att.mirror.groups() == (KVGroup(), KVGroup(6))


def test_publisher_events_name_the_group_and_chain_parents_only_within_it():
    from kvscope.engine import events as ev
    from kvscope.sessions.kv_events.publisher import TierHashes, to_kv_events

    def cached(blocks, hashes, parents, group=0):
        return ev.Event(ev.CACHED, 0, 1, tuple(blocks), 0, (*hashes, *parents), group=group)

    one = to_kv_events([cached([5, 6], [11, 12], [99, 11])], TierHashes(), 4)
    assert [(s.hashes, s.parent, s.group, s.spec_kind, s.sliding_window, s.medium)
            for s in one] == [([11, 12], None, 0, FULL, None, "GPU")]  # as vLLM 0.33 sends it
    hashes = TierHashes()
    out = to_kv_events([cached([1, 2], [11, 12], [99, 11]),
                        cached([3], [13], [12], group=1),  # 12 is cached in group 0 only
                        cached([4], [13], [12]),  # the same hash in group 0, after 12
                        ev.Event(ev.EVICTED, 0, 2, (3, 2), group=0)], hashes, 4, HYBRID)
    assert [(s.hashes, s.parent, s.group, s.sliding_window) for s in out[:3]] == \
        [([11, 12], None, 0, None), ([13], None, 1, 8), ([13], 12, 0, None)]
    # evicted by a group-0 allocation, each hash removed from the group it was cached in
    assert [(r.hashes, r.group) for r in out[3:]] == [([13], 1), ([12], 0)]
