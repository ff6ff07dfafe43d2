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


def _spans_inside(trace, lo_us, hi_us):
    for e in trace["traceEvents"]:
        if e["ph"] in ("X", "i", "C"):
            assert lo_us <= e["ts"] <= hi_us, e
            if e["ph"] == "X":
                assert e["ts"] + e["dur"] <= hi_us, e


def test_a_range_of_steps_exports_only_those_steps(tmp_path, recorded):
    from kvscope.sessions.export import export_range

    _, path = recorded
    first, last = 40, 69
    assert export_range(path, tmp_path / "r.json", first, last) == (first, last)
    trace = json.loads((tmp_path / "r.json").read_text())
    steps = [e for e in trace["traceEvents"] if e.get("cat") == "step"]
    assert [int(e["name"].split()[1]) for e in steps] == list(range(first, last + 1))
    assert trace["otherData"]["steps"] == [first, last]
    # Every event, span and counter lies inside the range's time (the same clock as the whole
    # session's trace), events of other steps are left out, and requests keep whole tracks.
    lo, hi = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    _spans_inside(trace, lo, hi)
    assert {e["args"]["step"] for e in trace["traceEvents"]
            if e["ph"] == "i" and "step" in e["args"]} <= set(range(first, last + 1))
    full = json.loads(export_chrome_trace(path, tmp_path / "all.json").read_text())
    full_steps = {e["name"]: e for e in full["traceEvents"] if e.get("cat") == "step"}
    assert all(full_steps[e["name"]] == e for e in steps)  # the same times as the full trace
    # A request already running when the range began starts there, in its phase then.
    assert any(e["ts"] == lo and e["name"] in ("prefill", "decode", "recompute")
               for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 2)

    assert export_range(path, tmp_path / "r.csv", first, last) == (first, last)
    with open(tmp_path / "r.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(first, last + 1))
    with SessionReader(path) as s:
        assert float(rows[0]["wall_s"]) == s.steps(first, first)[0].wall_s


def test_a_range_export_never_overwrites_the_session_or_a_file_silently(tmp_path, recorded):
    from kvscope.sessions.export import export_range

    _, path = recorded
    before = path.read_bytes()
    with pytest.raises(ValueError, match="refusing to overwrite the input"):
        export_range(path, path, 3, 9, overwrite=True)
    assert path.read_bytes() == before
    out = tmp_path / "taken.csv"
    out.write_text("mine")
    with pytest.raises(FileExistsError):
        export_range(path, out, 3, 9)
    assert out.read_text() == "mine" and not (tmp_path / "taken.csv.part").exists()
    assert export_range(path, out, 3, 9, overwrite=True) == (3, 9)
    assert len(out.read_text().splitlines()) == 1 + 7
    with SessionReader(path) as s:  # clipped to what the session has
        assert export_range(path, tmp_path / "end.csv", s.last_step - 2, s.last_step + 50) == \
            (s.last_step - 2, s.last_step)
    with pytest.raises(ValueError, match="none of the steps"):
        export_range(path, tmp_path / "none.csv", 10_000, 10_005)
