"""The Chrome trace of a session with KV-cache groups (a real hybrid model: full attention and a
sliding window of 6 tokens): per group a counter track of the blocks it holds and keeps cached,
and a track of its block events; checked against the live engine's own snapshots and published
events, for the whole session and for a range. A one-group session gets no group tracks."""

from __future__ import annotations

import json

import numpy as np
import pytest
from session_testutil import drive, make_engine

from kvscope.engine import events as ev
from kvscope.engine.kv_groups import NULL
from kvscope.engine.snapshot import ACTIVE, CACHED, SHARED
from kvscope.engine.stream import StepQueue
from kvscope.sessions import Recorder
from kvscope.sessions.export import export_chrome_trace, export_range

GROUP_KINDS = {ev.ALLOCATED, ev.CACHED, ev.EVICTED, ev.OUT_OF_WINDOW, ev.FREED}


def record(path, model_dir, max_steps):
    """The session, the live snapshot after every step, and every event the engine published."""
    engine = make_engine(model_dir)
    live, tap = [], StepQueue()
    engine.subscribe(tap)
    with Recorder(path, engine, keyframe_every=7):
        drive(engine, max_steps=max_steps, on_step=lambda e: live.append(e.snapshot()))
    return live, [e for u in tap.drain() for e in u.events]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, hybrid_model_dir):
    path = tmp_path_factory.mktemp("export_groups") / "hybrid.kvscope"
    return (path, *record(path, hybrid_model_dir, 90))


def per_group(snap, n):
    """(held, cached) per group from a live snapshot: its block states and block_group."""
    held = np.isin(snap.state, (ACTIVE, SHARED))
    return [(int((held & (snap.block_group == g)).sum()),
             int(((snap.state == CACHED) & (snap.block_group == g)).sum())) for g in range(n)]


def load(path):
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in events
               if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 1}
    # each step's end, where its counters are drawn
    step_of = {e["ts"] + e["dur"]: int(e["name"].split()[1]) for e in events
               if e.get("cat") == "step"}
    return trace, events, threads, step_of


def group_counters(events, step_of, names):
    """step -> [(held, cached) per group], read back from the counter tracks."""
    out: dict[int, list] = {}
    for e in events:
        if e["ph"] == "C" and e["name"].startswith("blocks: "):
            out.setdefault(step_of[e["ts"]], [None] * len(names))[
                names.index(e["name"].removeprefix("blocks: "))] = (
                e["args"]["held"], e["args"]["cached"])
    return out


def test_a_hybrid_session_has_a_counter_and_an_event_track_per_group(tmp_path, hybrid):
    path, live, published = hybrid
    trace, events, threads, step_of = load(export_chrome_trace(path, tmp_path / "t.json"))
    names = ["full attention", "sliding window 6"]
    assert trace["otherData"]["kv_cache_groups"] == names
    assert len(step_of) == len(live)  # step ends are distinct: a counter names its step
    assert {n for n in threads.values() if n.startswith("cache: ")} == \
        {f"cache: {n}" for n in names}
    got = group_counters(events, step_of, names)
    assert sorted(got) == [s.step for s in live]
    for snap in live:
        assert got[snap.step] == per_group(snap, 2), f"step {snap.step}"
    # the groups' blocks, where both have some: the window's fewer held, more cached
    assert any(h0 > h1 > 0 for (h0, _), (h1, _) in got.values())
    # all groups together hold what the pool's "blocks" counter calls active
    active = {step_of[e["ts"]]: e["args"]["active"] for e in events
              if e["ph"] == "C" and e["name"] == "blocks"}
    assert all(sum(h for h, _ in got[s]) == a for s, a in active.items())

    # each group's track holds exactly that group's block events, as the engine published them
    tid_of = {n.removeprefix("cache: "): t for t, n in threads.items()}
    for g, name in enumerate(names):
        shown = sorted((e["args"]["step"], e["cat"], tuple(e["args"]["blocks"]))
                       for e in events if e["ph"] == "i" and e["tid"] == tid_of[name]
                       and e["pid"] == 1)
        want = sorted((e.step, str(e.kind), tuple(b for b in e.blocks if b != NULL))
                      for e in published if e.kind in GROUP_KINDS and e.group == g)
        assert shown == want, name
    kinds = {(e["tid"], e["cat"]) for e in events if e["ph"] == "i" and e["pid"] == 1}
    assert (tid_of["sliding window 6"], "out_of_window") in kinds
    assert (tid_of["full attention"], "out_of_window") not in kinds
    assert all((tid_of[n], "evicted") in kinds for n in names)
    assert {c for t, c in kinds if threads[t] == "cache"} <= {"reset"}  # evictions moved
    hits = [e["name"] for e in events if e["ph"] == "i" and e["cat"] == "cache_hit"]
    assert any(n.endswith("(sliding window 6)") for n in hits)


def test_a_range_of_a_hybrid_session_has_the_group_counters_of_its_steps(tmp_path, hybrid):
    path, live, _ = hybrid
    first, last = 23, 61  # neither on a keyframe (every 7 steps)
    export_range(path, tmp_path / "r.json", first, last)
    _, events, _, step_of = load(tmp_path / "r.json")
    got = group_counters(events, step_of, ["full attention", "sliding window 6"])
    assert sorted(got) == list(range(first, last + 1))
    for step in (first, 40, last):
        assert got[step] == per_group(live[step], 2), f"step {step}"
    assert {e["args"]["step"] for e in events if e["ph"] == "i" and e["pid"] == 1} <= \
        set(range(first, last + 1))


def test_a_one_group_session_has_no_group_tracks(tmp_path, tiny_model_dir):
    path = tmp_path / "one.kvscope"
    record(path, tiny_model_dir, 30)
    trace, events, threads, _ = load(export_chrome_trace(path, tmp_path / "t.json"))
    assert sorted(threads.values()) == ["cache", "steps"]
    assert "kv_cache_groups" not in trace["otherData"]
    assert not any(e["name"].startswith("blocks: ") for e in events)
    assert not any("(full attention)" in e["name"] for e in events)
