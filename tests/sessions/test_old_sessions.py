"""Sessions recorded before the step stream (schema 1, no eviction policy, no cached_seq in
keyframes) still open and replay exactly with today's pool state machine."""

from __future__ import annotations

from pathlib import Path

from kvscope.engine import events as ev
from kvscope.sessions import SessionReader

OLD = Path(__file__).resolve().parents[1] / "data" / "session_before_step_stream.kvscope"


def test_a_session_recorded_before_the_step_stream_replays_exactly(tmp_path):
    copy = tmp_path / "old.kvscope"
    copy.write_bytes(OLD.read_bytes())  # the reader never writes, but keep the fixture pristine
    with SessionReader(copy) as s:
        assert s.meta.schema_version == 1 and "eviction_policy" not in s.meta.engine_config
        assert s.keyframe_steps == [0, 8, 16, 24, 32, 40]
        # Each keyframe interval replayed through today's BlockPool lands on the next keyframe.
        assert s.verify() == []
        events = s.events_between(s.first_step, s.last_step)
        assert all(isinstance(e.kind, ev.EventKind) for e in events)
        evicted = sum(len(e.blocks) for e in events if e.kind == ev.EVICTED)
        assert evicted == s.snapshot_at(s.last_step).num_evicted_blocks == 19
        for step in range(s.first_step, s.last_step + 1):  # every step replays
            snap = s.snapshot_at(step)
            assert snap.num_active_blocks + snap.num_cached_blocks + snap.num_free_blocks == 14
    assert copy.read_bytes() == OLD.read_bytes()
