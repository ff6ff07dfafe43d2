"""A session recorded before events carried typed fields (and before the one lifecycle fold)
opens and replays exactly; today's engine process, recorder and replay source fold the same
scenario into the same rows as the code of then did (tests/sessions/before_typed_events.py)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from before_typed_events import replay_rows, run

from kvscope.engine import events as ev
from kvscope.sessions import SessionReader

DATA = Path(__file__).resolve().parents[1] / "data"
OLD = DATA / "session_before_typed_events.kvscope"
EXPECTED = json.loads((DATA / "session_before_typed_events.rows.json").read_text())


def _copy(tmp_path) -> Path:
    copy = tmp_path / "old.kvscope"
    copy.write_bytes(OLD.read_bytes())  # the reader never writes, but keep the fixture pristine
    return copy


def _json(value):
    return _as_then(json.loads(json.dumps(value, sort_keys=True)))


def _as_then(value):
    """Rows as the code of then wrote them: without the fields added since, which must hold
    their defaults here (host_cached_tokens: no host tier)."""
    if isinstance(value, dict) and "host_cached_tokens" in value:
        assert value.pop("host_cached_tokens") == 0
    if isinstance(value, dict):
        return {k: _as_then(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_then(v) for v in value]
    return value


def test_an_old_session_replays_its_rows_cached_tokens_and_finish_reasons_exactly(tmp_path):
    copy = _copy(tmp_path)
    got = _json(replay_rows(copy))
    assert got == EXPECTED["replay_rows"]
    last = got[max(got, key=int)]
    states = {r["request_id"]: r["state"] for r in last}
    assert states == {0: "finished: length", 1: "finished: cancelled", 2: "finished: rejected",
                      3: "finished: length", 4: "finished: length", 5: "finished: length"}
    assert {r["request_id"]: r["cached_tokens"] for r in last}[1] == 32  # the prefix hit
    with SessionReader(copy) as s:
        assert s.verify() == []
        assert sum(r.num_preempted for r in s.steps()) == 1


def test_today_folds_the_scenario_as_the_code_of_then(tmp_path):
    """The engine process's request table after every action, and the recorder's request rows
    and the replay source's rows of a new recording, equal those of the old code."""
    path = tmp_path / "new.kvscope"
    assert _json(run(path)) == EXPECTED["live_rows"]
    with SessionReader(path) as new, SessionReader(_copy(tmp_path)) as old:
        assert [_untimed(r) for r in new.requests()] == [_untimed(r) for r in old.requests()]
        assert [(e.kind, e.request_id, e.blocks, e.detail)
                for e in new.events_between(new.first_step, new.last_step)] == \
            [(e.kind, e.request_id, e.blocks, e.detail)
             for e in old.events_between(old.first_step, old.last_step)]
    assert _unkeyed(_json(replay_rows(path))) == _unkeyed(EXPECTED["replay_rows"])


def _untimed(r) -> dict:
    """A recorded request without its times, its salt digest (keyed per recording) as whether
    it has one."""
    d = {k: v for k, v in asdict(r).items() if not k.endswith("_s")}
    d["salt_digest"] = d["salt_digest"] is not None
    return d


def _unkeyed(rows: dict) -> dict:
    """Replay rows without times, each salt digest as whether there is one."""
    return {s: [{**{k: v for k, v in r.items() if k not in ("ttft_s", "tpot_s")},
                 "cache_salt": r["cache_salt"] is not None} for r in step_rows]
            for s, step_rows in rows.items()}


def test_the_old_file_has_every_lifecycle_kind():
    with SessionReader(OLD) as s:
        kinds = {e.kind for e in s.events_between(s.first_step, s.last_step)}
    assert {ev.ARRIVED, ev.ADMITTED, ev.PREEMPTED, ev.CANCELLED, ev.REJECTED, ev.FINISHED,
            ev.CACHE_HIT, ev.EVICTED} <= kinds


def test_the_old_files_events_have_their_named_fields():
    with SessionReader(OLD) as s:
        events = s.events_between(s.first_step, s.last_step)
    admitted = [(e.request_id, e.cached_tokens, e.computed_tokens) for e in events
                if e.kind == ev.ADMITTED]
    assert admitted[:2] == [(0, 0, 43), (1, 32, 10)]  # the second hit two blocks
    assert all(f"{c} cached, {n} to compute" == e.detail for (_, c, n), e in
               zip(admitted, [e for e in events if e.kind == ev.ADMITTED], strict=True))
    assert [e.prompt_tokens for e in events if e.kind == ev.ARRIVED][:2] == [43, 42]
    assert {e.reason for e in events if e.kind == ev.FINISHED} == {"length"}
    assert [e.reason for e in events if e.kind == ev.REJECTED] == ["empty prompt"]
