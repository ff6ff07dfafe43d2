"""Chrome trace (Perfetto) and CSV export of a recorded session."""

from __future__ import annotations

import csv
import json
from collections import defaultdict

import pytest
from session_testutil import drive, make_engine

from kvscope.sessions import Recorder, SessionReader
from kvscope.sessions.export import export_chrome_trace, export_csv


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    path = tmp_path_factory.mktemp("export") / "run.kvscope"
    with Recorder(path, engine):
        drive(engine, max_steps=120)
    return engine, path


def test_chrome_trace_tracks_and_valid_nesting(tmp_path, recorded):
    engine, path = recorded
    out = export_chrome_trace(path, tmp_path / "trace.json")
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    assert {e["ph"] for e in events} == {"M", "X", "C", "i"}
    for e in events:
        assert {"ph", "pid", "name"} <= e.keys()
        if e["ph"] != "M":
            assert isinstance(e["ts"], int)
        if e["ph"] == "X":
            assert isinstance(e["dur"], int) and e["dur"] >= 0

    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert set(procs.values()) == {"engine", "requests"}
    engine_pid = next(p for p, n in procs.items() if n == "engine")
    req_pid = next(p for p, n in procs.items() if n == "requests")
    assert {names[(engine_pid, t)] for t in (1, 2)} == {"steps", "cache"}
    request_tracks = {n for (p, _), n in names.items() if p == req_pid}
    assert {f"request {r}" for r, q in engine.requests.items() if q.parent_id is None} <= \
        request_tracks
    assert any("sample" in n for n in request_tracks)

    spans = [e for e in events if e["ph"] == "X"]
    steps = [e for e in spans if e.get("cat") == "step"]
    assert len(steps) == engine.num_steps
    assert {e["name"] for e in spans if e["pid"] == engine_pid} >= {"prefill", "decode"}
    assert {e["name"] for e in spans if e["pid"] == req_pid} >= \
        {"queued", "prefill", "decode", "preempted", "recompute"}
    counters = {(e["name"], k) for e in events if e["ph"] == "C" for k in e["args"]}
    assert {("blocks", "free"), ("blocks", "active"), ("blocks", "cached"),
            ("token hit rate", "cumulative")} <= counters
    instants = {e["cat"] for e in events if e["ph"] == "i"}
    assert {"evicted", "preempted", "cancelled", "reset"} <= instants

    # Spans on one track nest: each pair is disjoint or one contains the other.
    tracks = defaultdict(list)
    for e in spans:
        tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for key, intervals in tracks.items():
        stack = []
        for a, b in sorted(intervals, key=lambda x: (x[0], -x[1])):
            while stack and stack[-1] <= a:
                stack.pop()
            assert not stack or b <= stack[-1], f"partial overlap on track {key}: {(a, b)}"
            stack.append(b)
    # Every request track is a sequence of phases (no nesting at all) in time order.
    for (pid, _tid), intervals in tracks.items():
        if pid == req_pid:
            iv = sorted(intervals)
            assert all(b1 <= a2 for (_, b1), (a2, _) in zip(iv, iv[1:], strict=False))


def test_csv_export(tmp_path, recorded):
    engine, path = recorded
    req_csv, steps_csv = export_csv(path, tmp_path / "csv")
    with open(req_csv, newline="") as f:
        reqs = list(csv.DictReader(f))
    with open(steps_csv, newline="") as f:
        steps = list(csv.DictReader(f))
    assert [int(r["request_id"]) for r in reqs] == sorted(engine.requests)
    assert len(steps) == engine.num_steps
    assert [int(s["step"]) for s in steps] == list(range(engine.num_steps))
    assert {"ttft_s", "tpot_s", "finish_reason", "salt_digest"} <= reqs[0].keys()
    assert {"wall_s", "prefill_s", "decode_s", "num_free_blocks", "total_hit_tokens"} <= \
        steps[0].keys()
    rec = engine.step_records[5]
    assert float(steps[5]["wall_s"]) == rec.wall_s
    with SessionReader(path) as s:
        assert len(s.requests()) == len(reqs)
