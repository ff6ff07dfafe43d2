"""Sessions keep every admission's miss explanation: replay answers "why did this miss?" as the
live engine did at that step."""

from __future__ import annotations

import sqlite3

from session_testutil import drive, make_engine

from kvscope.engine import explain
from kvscope.sessions import Recorder, SessionReader


def test_replay_explains_each_miss_as_the_engine_did(tmp_path, tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    path = tmp_path / "s.kvscope"
    live = {}  # step -> the engine's explanations after it
    with Recorder(path, engine):
        drive(engine, on_step=lambda e: live.__setitem__(e.num_steps - 1,
                                                         dict(e.manager.explanations)),
              max_steps=120)
    reasons = {why.reason for whys in live.values() for why in whys.values()}
    assert explain.EVICTED in reasons  # the workload exercises the interesting answer
    with SessionReader(path) as reader:
        for step in range(0, 120, 7):
            for rid, why in live[step].items():
                assert reader.explanation(rid, step) == why, (step, rid)
        never = max(live[119]) + 1000
        assert reader.explanation(never) is None
        first = min(live[119])
        assert reader.explanation(first, step=-1) is None  # not admitted yet


def test_a_version_1_file_opens_without_explanations(tmp_path, tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    path = tmp_path / "old.kvscope"
    with Recorder(path, engine):
        drive(engine, max_steps=20)
    with sqlite3.connect(path) as conn:  # what a version 1 recorder wrote
        conn.execute("DROP TABLE explanations")
        conn.execute("UPDATE session SET schema_version = 1")
        conn.execute("PRAGMA user_version = 1")
    with SessionReader(path) as reader:
        assert reader.meta.schema_version == 1
        assert reader.explanation(0) is None
        assert reader.snapshot_at(reader.last_step).step == reader.last_step


def test_events_published_names_the_step_that_published_each_event(tmp_path, tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    path = tmp_path / "s.kvscope"
    with Recorder(path, engine):
        drive(engine, max_steps=60)  # cancels between steps: stamped N, published N + 1
    with SessionReader(path) as reader:
        per_step = [(s, e) for s in reader.step_numbers for e in reader.events_at(s)]
        assert reader.events_published(reader.first_step, reader.last_step) == per_step
        assert any(s != e.step for s, e in per_step)
        kinds = {"cancelled", "finished"}
        assert reader.events_published(0, 59, kinds) == [(s, e) for s, e in per_step
                                                          if e.kind in kinds]
