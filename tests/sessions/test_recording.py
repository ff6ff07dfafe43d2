"""Record real engine runs and replay them: every step's snapshot equals the live one."""

from __future__ import annotations

import logging
import random
import subprocess
import sys
import threading
import time

import pytest
from session_testutil import drive, make_engine, prompt, snapshot_digest, stored, stored_event

from kvscope.engine import SamplingParams
from kvscope.engine import events as ev
from kvscope.engine.stream import StepQueue
from kvscope.sessions import Recorder, SessionReader
from kvscope.sessions.recorder import Recorder as _Recorder


def record(tmp_path, model_dir, name="run.kvscope", policy="lru", host_blocks=0, **rec_kw):
    engine = make_engine(model_dir, eviction_policy=policy, host_blocks=host_blocks)
    live = []
    path = tmp_path / name
    tap = StepQueue()
    engine.subscribe(tap)  # every event the engine published, to compare
    with Recorder(path, engine, **rec_kw) as rec:
        drive(engine, on_step=lambda e: live.append(e.snapshot()))
    engine.published = [(u.record.step, e) for u in tap.drain() for e in u.events]
    return engine, live, path, rec


@pytest.mark.parametrize("model,keyframe_every", [("llama", 7), ("llama", 10_000),
                                                   ("hybrid", 7), ("host", 7),
                                                   ("hybrid-host", 7)])
def test_every_replayed_step_equals_the_live_snapshot(tmp_path, request, model, keyframe_every):
    """hybrid: full-attention and sliding-window layers, two KV-cache groups (the window
    releases blocks mid-request: out_of_window events; group 1's tables have nulls). host: a
    host tier behind the pool (blocks loaded back from it are registered on the device).
    hybrid-host: both (the host tier takes and gives back blocks of each group)."""
    model_dir = request.getfixturevalue("hybrid_model_dir" if "hybrid" in model else
                                        "tiny_model_dir")
    engine, live, path, rec = record(tmp_path, model_dir, keyframe_every=keyframe_every,
                                     keyframe_budget=1.0,  # exactly every K steps
                                     host_blocks=24 if "host" in model else 0)
    status = rec.status()
    assert status.error is None and status.steps_written == len(live) == engine.num_steps
    with SessionReader(path) as s:
        assert s.meta.complete and s.meta.block_size == 4 and s.meta.num_blocks == 40
        assert (s.first_step, s.last_step) == (0, len(live) - 1)
        published = engine.published  # (step of the update, event), as the engine sent them
        assert s.block_hashes == "keyed"
        published = [(st, stored_event(e, rec)) for st, e in published]
        assert s.events_between(s.first_step, s.last_step) == [e for _, e in published]
        for step in (0, 5, len(live) - 1):
            assert s.events_at(step) == [e for st, e in published if st == step]
        live = [stored(x, rec) for x in live]  # hashes as this file stores them
        kinds = {e.kind for _, e in published}
        want = set(ev.BLOCK_EVENTS) - ({ev.OUT_OF_WINDOW} if "hybrid" not in model else set())
        if "host" in model:
            want |= set(ev.HOST_EVENTS)
        assert want <= kinds, want - kinds  # all exercised
        if model == "hybrid-host":
            assert {(e.kind, e.group) for _, e in published if e.kind in ev.HOST_EVENTS} >= {
                (ev.OFFLOADED, 0), (ev.OFFLOADED, 1), (ev.LOADED, 0), (ev.LOADED, 1)}
        if "hybrid" in model:
            assert {e.group for _, e in published} == {0, 1}
            assert any(-1 in t for x in live for g in x.more_tables for t in g.values())
        assert {ev.PREEMPTED, ev.CANCELLED, ev.REJECTED} <= kinds
        # In order (the playback cursor), then in random order (keyframe + replay each time).
        assert [f.snapshot.step for f in s.playback()] == [x.step for x in live]
        for frame, want in zip(s.playback(), live, strict=True):
            assert frame.snapshot.equals(want), f"step {want.step}"
        order = list(range(len(live)))
        random.Random(0).shuffle(order)
        for i in order:
            assert s.snapshot_at(i).equals(live[i]), f"step {i}"
        assert s.verify() == []
        assert s.steps() == engine.step_records
        if keyframe_every == 7:
            assert s.keyframe_steps == list(range(0, len(live), 7))
        else:
            assert s.keyframe_steps == [0]


@pytest.mark.parametrize("policy", ["fifo", "lfu"])
def test_replay_equals_live_under_each_eviction_policy(tmp_path, tiny_model_dir, policy):
    """Replay drives the engine's own BlockPool under the recorded policy, restarting from
    keyframes: every step equals the live snapshot."""
    engine, live, path, rec = record(tmp_path, tiny_model_dir, policy=policy, keyframe_every=7,
                                     keyframe_budget=1.0)
    assert engine.counters().num_evicted_blocks > 0  # the policy chose victims
    with SessionReader(path) as s:
        assert s.meta.engine_config["eviction_policy"] == policy
        order = list(range(len(live)))
        random.Random(1).shuffle(order)
        for i in order:
            assert s.snapshot_at(i).equals(stored(live[i], rec)), f"step {i}"
        assert s.verify() == []


@pytest.mark.parametrize("config", [dict(enable_prefix_caching=False),
                                    dict(enable_kv_cache=False, num_blocks=8)])
def test_round_trip_without_prefix_caching_and_in_the_naive_loop(tmp_path, tiny_model_dir,
                                                                 config):
    engine = make_engine(tiny_model_dir, **config)
    live = []
    with Recorder(tmp_path / "cfg.kvscope", engine, keyframe_every=5, raw_hashes=True):
        if engine.config.enable_kv_cache:
            drive(engine, max_steps=30, on_step=lambda e: live.append(e.snapshot()))
        else:  # n > 1 is not used: the engine's naive loop cannot fork (reported)
            for i in range(4):
                engine.add_request(prompt(5 + 3 * i, i), SamplingParams(max_tokens=4 + i))
            while engine.has_unfinished():
                engine.step()
                live.append(engine.snapshot())
    with SessionReader(tmp_path / "cfg.kvscope") as s:
        assert s.num_steps == len(live) and s.meta.engine_config["enable_kv_cache"] == \
            config.get("enable_kv_cache", True)
        assert s.block_hashes == "raw"
        assert all(s.snapshot_at(x.step).equals(x) for x in live)


def test_requests_table_matches_the_engine(tmp_path, tiny_model_dir):
    engine, _, path, _ = record(tmp_path, tiny_model_dir)
    with SessionReader(path) as s:
        rows = {r.request_id: r for r in s.requests()}
    assert rows.keys() == engine.requests.keys()
    digests = {}
    for rid, req in engine.requests.items():
        row, m = rows[rid], req.metrics
        assert (row.parent_id, row.sample_index) == (req.parent_id, req.sample_index)
        assert row.prompt_tokens == len(req.prompt_token_ids)
        assert row.output_tokens == len(req.output_token_ids)
        assert row.cached_tokens == m.cached_tokens
        assert row.status == req.status.value
        assert (row.finish_reason, row.error) == (req.finish_reason, req.error)
        assert (row.arrival_s, row.first_scheduled_s, row.first_token_s, row.finished_s) == \
            (m.arrival_s, m.first_scheduled_s, m.first_token_s, m.finished_s)
        assert (row.ttft_s, row.tpot_s, row.num_preemptions) == \
            (m.ttft_s, m.tpot_s, m.num_preemptions)
        assert row.params["max_tokens"] == req.params.max_tokens
        assert row.prompt_text is None and row.output_text is None
        if req.cache_salt is None:
            assert row.salt_digest is None
        else:  # one digest per salt, within the session
            assert digests.setdefault(req.cache_salt, row.salt_digest) == row.salt_digest
    assert len(set(digests.values())) == len(digests) == 2
    assert sum(r.num_preemptions for r in rows.values()) > 0
    assert {r.finish_reason for r in rows.values()} >= {"length", "cancelled", "rejected"}


def test_prompt_text_and_salt_are_stored_only_with_the_opt_in(tmp_path):
    from kvscope.engine import Engine, EngineConfig

    secret = "Zebra quartz umbrella 4417 is the passphrase"
    salt = "tenant-secret-salt-31337"
    for record_text in (False, True):
        engine = Engine.from_pretrained("demo", EngineConfig(num_blocks=64))
        path = tmp_path / f"text-{record_text}.kvscope"
        with Recorder(path, engine, record_text=record_text):
            engine.generate([secret], SamplingParams(max_tokens=4), cache_salt=salt)
        assert not (tmp_path / f"{path.name}-wal").exists()
        data = path.read_bytes()
        assert salt.encode() not in data
        with SessionReader(path) as s:
            (row,) = s.requests()
        if record_text:
            assert secret.encode() in data and row.prompt_text.strip() == secret
            assert row.output_text is not None
        else:
            for needle in (secret, "Zebra", "passphrase"):
                assert needle.encode() not in data and needle.encode("utf-16-le") not in data
            assert row.prompt_text is None and row.output_text is None
            assert row.prompt_tokens > 0 and row.output_tokens == 4


def test_hook_covers_generate_and_close_unhooks(tmp_path, tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=64)
    path = tmp_path / "gen.kvscope"
    rec = Recorder(path, engine).start()
    assert engine._subscribers == [rec._on_update]
    engine.generate([[5, 6, 7, 8, 9, 10]] * 3, SamplingParams(max_tokens=5, ignore_eos=True))
    doomed = engine.add_request([9] * 10, SamplingParams(max_tokens=8))
    engine.step()
    engine.cancel(doomed)  # after the last recorded step
    late = engine.add_request([7] * 5, SamplingParams(max_tokens=2))  # never stepped
    rec.close()
    assert engine._subscribers == []
    engine.step()  # no longer recorded, and nothing breaks
    assert rec.status().steps_written == engine.num_steps - 1
    assert rec.close().steps_written == engine.num_steps - 1  # idempotent
    with SessionReader(path) as s:
        rows = {r.request_id: r for r in s.requests()}
    assert (rows[doomed].status, rows[doomed].finish_reason) == ("finished", "cancelled")
    assert (rows[late].status, rows[late].output_tokens) == ("waiting", 0)
    assert all(rows[r].finish_reason == "length" for r in range(3))


def test_recording_driven_from_a_worker_thread(tmp_path, tiny_model_dir):
    """As in the GUI: the worker thread owns the engine and the recorder; another thread polls
    the recorder's status."""
    path = tmp_path / "worker.kvscope"
    box = {}

    def worker():
        engine = make_engine(tiny_model_dir)
        rec = box["rec"] = Recorder(path, engine, flush_interval_s=0.02).start()
        box["steps"] = drive(engine, max_steps=60)
        box["final"] = rec.close()

    t = threading.Thread(target=worker)
    t.start()
    polled = []
    while t.is_alive():
        if "rec" in box:
            polled.append(box["rec"].status())
        time.sleep(0.005)
    t.join()
    assert box["final"].steps_written == box["steps"] and box["final"].error is None
    assert any(p.recording and p.steps_written > 0 for p in polled)
    with SessionReader(path) as s:
        assert s.num_steps == box["steps"] and s.verify() == []


def test_a_slow_writer_is_reported_and_nothing_is_dropped(tmp_path, tiny_model_dir, caplog,
                                                          monkeypatch):
    slow = _Recorder._write

    def write(self, batch):
        time.sleep(0.3)
        slow(self, batch)

    monkeypatch.setattr(_Recorder, "_write", write)
    engine = make_engine(tiny_model_dir)
    seen = []
    with caplog.at_level(logging.WARNING, logger="kvscope.sessions"):
        rec = Recorder(tmp_path / "slow.kvscope", engine, lag_steps=5, flush_interval_s=0.01)
        rec.start()
        drive(engine, max_steps=40, on_step=lambda e: seen.append(rec.status().lagging))
        status = rec.close()
    assert any(seen) and status.lag_episodes >= 1 and status.max_backlog_steps > 5
    assert "falling behind" in caplog.text
    assert status.steps_written == engine.num_steps and status.error is None
    with SessionReader(tmp_path / "slow.kvscope") as s:
        assert s.num_steps == engine.num_steps and s.meta.recorder_stats["lag_episodes"] >= 1


def test_a_failing_writer_stops_recording_but_never_the_engine(tmp_path, tiny_model_dir,
                                                               monkeypatch):
    def write(self, batch):
        raise OSError("disk full")

    monkeypatch.setattr(_Recorder, "_write", write)
    engine = make_engine(tiny_model_dir)
    rec = Recorder(tmp_path / "fail.kvscope", engine, flush_interval_s=0.01).start()
    drive(engine, max_steps=30)
    status = rec.close()
    assert engine.num_steps >= 30 and status.error == "OSError: disk full"
    with SessionReader(tmp_path / "fail.kvscope") as s:  # the header and metadata are there
        assert s.num_steps == 0 and not s.meta.complete


def test_a_session_being_recorded_can_be_read(tmp_path, tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    path = tmp_path / "live.kvscope"
    live = []
    rec = Recorder(path, engine, flush_interval_s=0.01, keyframe_every=5).start()
    drive(engine, max_steps=30, on_step=lambda e: live.append(e.snapshot()))
    deadline = time.monotonic() + 10
    while rec.status().steps_written < 30 and time.monotonic() < deadline:
        time.sleep(0.01)
    with SessionReader(path) as s:
        assert not s.meta.complete and s.num_steps == 30
        assert all(s.snapshot_at(i).equals(stored(live[i], rec)) for i in range(30))
    rec.close()


def test_refuses_to_overwrite_and_needs_events(tmp_path, tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    path = tmp_path / "x.kvscope"
    path.write_bytes(b"keep me")
    with pytest.raises(FileExistsError):
        Recorder(path, engine).start()
    assert path.read_bytes() == b"keep me"
    quiet = make_engine(tiny_model_dir, record_events=False)
    with pytest.raises(ValueError, match="record_events"):
        Recorder(tmp_path / "y.kvscope", quiet).start()


def test_reading_a_session_never_imports_torch(tmp_path, tiny_model_dir):
    _, live, path, rec = record(tmp_path, tiny_model_dir)
    code = (
        "import sys\n"
        "from kvscope.sessions import SessionReader\n"
        "from kvscope.sessions.export import chrome_trace\n"
        f"s = SessionReader({str(path)!r})\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from session_testutil import snapshot_digest\n"
        "print(snapshot_digest(s.snapshot_at(s.last_step - 3)))\n"
        "chrome_trace(s)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    here = str(__import__("pathlib").Path(__file__).parent)
    out = subprocess.run([sys.executable, "-c", code, here], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == snapshot_digest(stored(live[-4], rec))


def test_packed_events_round_trip_odd_cases():
    from kvscope.engine.events import Event
    from kvscope.sessions import schema

    events = [Event("reset", 7, None, (3, 1, 2), 10, (), ""),
              Event("cached", 7, 4, (5, 6), 11, (2**64 - 1, 0), "a\x1fb"),  # separator inside
              Event("freed", 6, 4, tuple(range(1000)), 12, (), "[not json"),
              Event("decode", 7, 2**40, (), 13, (), "1")]
    for batch in (events, events[2:], events[3:]):
        row = schema.pack_events(7, schema.event_tuples(batch))
        got = [Event(k, st, rid, b, t, h, d) for k, st, rid, b, h, t, d in
               schema.unpack_events(row)]
        assert got == batch


def test_requests_queued_before_the_recording_starts_are_recorded_once(tmp_path, tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    ids = [engine.add_request(prompt(6, i), SamplingParams(max_tokens=3)) for i in range(3)]
    with Recorder(tmp_path / "late.kvscope", engine) as rec:  # before their first step
        while engine.has_unfinished():
            engine.step()
    assert rec.status().error is None
    with SessionReader(tmp_path / "late.kvscope") as s:
        rows = s.requests()
    assert [r.request_id for r in rows] == ids
    assert all(r.status == "finished" and r.output_tokens == 3 for r in rows)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_seeks_restart_from_kept_replays_and_still_equal_live(tmp_path, tiny_model_dir, policy):
    """A seek keeps replays at keyframes and halfway to the next one; later seeks copy the
    nearest (the copies never change the kept ones)."""
    engine, live, path, rec = record(tmp_path, tiny_model_dir, policy=policy, keyframe_every=40,
                                     keyframe_budget=1.0)
    with SessionReader(path) as s:
        assert s.keyframe_steps[:2] == [0, 40]
        order = list(range(len(live))) * 2
        random.Random(2).shuffle(order)
        for i in order:
            assert s.snapshot_at(i).equals(stored(live[i], rec)), f"step {i}"
        assert {0, 20, 40, 60} <= set(s._at_keyframe)  # keyframes and their midpoints
