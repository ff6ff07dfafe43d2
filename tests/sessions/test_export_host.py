"""The Chrome trace of a session with a host tier: a "host transfers" track with a span per step
that copied blocks (as long as the copies took, at the step's start, before its forward pass;
its args the blocks and bytes moved) and a "host blocks" counter track equal to the replayed
host pool; a session without a tier has none of it."""

from __future__ import annotations

import json

import pytest
from session_testutil import drive, make_engine

from kvscope.sessions import Recorder, SessionReader
from kvscope.sessions.export import ENGINE_PID, chrome_trace, export_chrome_trace


@pytest.fixture(scope="module")
def host_session(tmp_path_factory, tiny_model_dir):
    """A real engine on a tiny Llama with a host tier of 24 blocks behind a pool of 40: the
    workload offloads evicted blocks and loads prefixes back (every host event)."""
    engine = make_engine(tiny_model_dir, host_blocks=24)
    path = tmp_path_factory.mktemp("export_host") / "host.kvscope"
    with Recorder(path, engine):
        drive(engine, max_steps=120)
    BLOCK_BYTES[path] = engine.runner.kv_cache[:, :, 0].nbytes  # one block, every layer, K, V
    return path


BLOCK_BYTES = {}  # session -> a block's KV bytes, measured on the cache tensor


def _track(events, name: str) -> int:
    return next(e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"
                and e["pid"] == ENGINE_PID and e["args"]["name"] == name)


def test_transfer_spans_are_the_steps_copies(tmp_path, host_session):
    with SessionReader(host_session) as r:  # the step records, read on their own
        records = r.steps()
    copied = [s for s in records if s.offloaded_blocks or s.loaded_blocks]
    assert sum(s.offloaded_blocks for s in copied) > 10 and sum(s.loaded_blocks
                                                                 for s in copied) > 3
    out = export_chrome_trace(host_session, tmp_path / "trace.json")
    events = json.loads(out.read_text())["traceEvents"]
    tid = _track(events, "host transfers")
    spans = [e for e in events if e["ph"] == "X" and e["pid"] == ENGINE_PID and e["tid"] == tid]
    assert len(spans) == len(copied)
    steps = {e["name"]: e for e in events if e["ph"] == "X" and e.get("cat") == "step"}
    forward = {(e["args"]["step"], e["name"]): e for e in events
               if e["ph"] == "X" and e.get("cat") in ("prefill", "decode")}
    for span, rec in zip(spans, copied, strict=True):
        assert span["args"] == dict(
            offloaded_blocks=rec.offloaded_blocks, loaded_blocks=rec.loaded_blocks,
            offloaded_bytes=rec.offloaded_blocks * BLOCK_BYTES[host_session],
            loaded_bytes=rec.loaded_blocks * BLOCK_BYTES[host_session], step=rec.step)
        assert span["cat"] == "transfer" and span["dur"] == round(rec.transfer_s * 1e6) > 0
        step = steps[f"step {rec.step}"]
        assert span["ts"] == step["ts"] and span["ts"] + span["dur"] <= step["ts"] + step["dur"]
        # the step's forward pass follows its copies
        first = forward.get((rec.step, "prefill")) or forward.get((rec.step, "decode"))
        if first is not None:
            assert first["ts"] == span["ts"] + span["dur"]


def test_host_block_counters_equal_the_replayed_host_pool(host_session):
    with SessionReader(host_session) as r:
        trace = chrome_trace(r)
        last = r.last_step
    events = trace["traceEvents"]
    ends = {e["ts"] + e["dur"]: int(e["name"].split()[1]) for e in events
            if e["ph"] == "X" and e.get("cat") == "step"}
    counters = {ends[e["ts"]]: e["args"] for e in events
                if e["ph"] == "C" and e["name"] == "host blocks"}
    assert sorted(counters) == list(range(last + 1))
    with SessionReader(host_session) as fresh:  # snapshots replayed by another reader
        loaded = [s.step for s in fresh.steps() if s.loaded_blocks]
        for step in (0, loaded[0], loaded[len(loaded) // 2], last // 2, last):
            host = fresh.snapshot_at(step).host
            assert counters[step] == dict(free=host.num_free_blocks,
                                          active=host.num_active_blocks,
                                          cached=host.num_cached_blocks), step
    assert max(c["cached"] for c in counters.values()) > 0


def test_a_session_without_a_host_tier_has_no_host_tracks(tmp_path, tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    path = tmp_path / "one.kvscope"
    with Recorder(path, engine):
        drive(engine, max_steps=40)
    with SessionReader(path) as r:
        assert not r.has_host_tier and r.host_blocks(0, r.last_step) == {}
        events = chrome_trace(r)["traceEvents"]
    assert not [e for e in events if "host" in e["name"] or e.get("cat") == "transfer"]
    assert not [e for e in events if e["ph"] == "M" and "host" in e["args"].get("name", "")]
