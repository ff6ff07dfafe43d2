"""ARRIVED, ADMITTED, FINISHED and REJECTED carry their numbers and reasons as named fields,
live and read back from a session (which keeps them packed in the detail text)."""

from __future__ import annotations

import pytest

from kvscope.engine import Engine, EngineConfig, SamplingParams
from kvscope.engine import events as ev
from kvscope.sessions import Recorder, SessionReader
from kvscope.sessions.schema import event_values


def test_lifecycle_events_carry_named_fields_live_and_in_a_session(tmp_path):
    engine = Engine.from_pretrained("demo", EngineConfig(num_blocks=32))
    got = []
    engine.subscribe(lambda u: got.extend(u.events))
    shared = list(range(100, 140))
    path = tmp_path / "s.kvscope"
    with Recorder(path, engine):
        engine.generate([shared + [1, 2]], SamplingParams(max_tokens=2, ignore_eos=True))
        engine.generate([shared + [3]], SamplingParams(max_tokens=2, ignore_eos=True))
        engine.add_request([], SamplingParams(max_tokens=2))  # rejected
        engine.step()
    by_kind = {}
    for e in got:
        by_kind.setdefault(e.kind, []).append(e)
    assert [e.prompt_tokens for e in by_kind[ev.ARRIVED]] == [42, 41]
    assert [(e.cached_tokens, e.computed_tokens) for e in by_kind[ev.ADMITTED]] == \
        [(0, 42), (32, 9)]
    assert [e.reason for e in by_kind[ev.FINISHED]] == ["length", "length"]
    assert [e.reason for e in by_kind[ev.REJECTED]] == ["empty prompt"]
    assert by_kind[ev.ADMITTED][1].detail == "32 cached, 9 to compute"  # still shown as before
    with SessionReader(path) as s:
        read = [e for e in s.events_between(s.first_step, s.last_step)
                if e.kind in ev.VALUES]
    assert [(e.kind, e.request_id, e.values) for e in read] == \
        [(e.kind, e.request_id, e.values) for e in got if e.kind in ev.VALUES]


def test_a_kind_without_a_field_says_so():
    e = ev.Event(ev.COW, 0, 1, (2, 3))
    with pytest.raises(ValueError, match="no cached_tokens"):
        _ = e.cached_tokens
    assert ev.Event(ev.ADMITTED, 0, 1).cached_tokens is None  # no values: a damaged file


@pytest.mark.parametrize("kind,values", [
    (ev.ARRIVED, (17,)), (ev.ADMITTED, (336, 1108)), (ev.FINISHED, ("error: boom, 3 cached",)),
    (ev.REJECTED, ("prompt (9000 tokens) + max_tokens (16) exceeds the model's 2048",)),
    (ev.FINISHED, ("",))])
def test_the_session_codec_unpacks_what_the_engine_writes(kind, values):
    log = ev.EventLog()
    getattr(log, str(kind))(3, 7, *values)
    (e,) = log.drain()
    assert e.values == values and event_values(kind, e.detail) == values


def test_a_detail_that_does_not_match_has_no_values():
    assert event_values(ev.ADMITTED, "a lot cached") == ()
    assert event_values(ev.PREEMPTED, "12 tokens to recompute") == ()
