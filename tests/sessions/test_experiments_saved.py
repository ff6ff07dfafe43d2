"""Experiment results saved in a session file (also while it is being recorded) come back from
the reader; old files without the table open with none and can take one."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvscope.engine import Engine, EngineConfig, SamplingParams
from kvscope.lab.experiments import run
from kvscope.sessions import NotASessionError, Recorder, SessionReader
from kvscope.sessions.errors import MissingSessionError
from kvscope.sessions.experiments import save_experiment

OLD = Path(__file__).resolve().parents[1] / "data" / "session_before_step_stream.kvscope"


@pytest.fixture(scope="module")
def result():
    return run("block-size", quick=True)


def test_a_result_saved_while_recording_replays_with_the_session(tmp_path, result):
    path = tmp_path / "s.kvscope"
    engine = Engine.from_pretrained("demo", EngineConfig(num_blocks=64))
    rec = Recorder(path, engine).start()
    engine.generate([[5, 6, 7, 8] * 5], SamplingParams(max_tokens=3))
    assert save_experiment(path, result) == 1
    engine.generate([[9, 10, 11] * 5], SamplingParams(max_tokens=3))
    rec.close()
    with SessionReader(path) as s:
        assert s.experiments() == [result]
        assert s.num_steps > 0 and s.verify() == []


def test_an_old_session_has_no_experiments_and_takes_one(tmp_path, result):
    copy = tmp_path / "old.kvscope"
    copy.write_bytes(OLD.read_bytes())
    with SessionReader(copy) as s:
        assert s.experiments() == []
    save_experiment(copy, result)
    save_experiment(copy, result)
    with SessionReader(copy) as s:
        assert [r.name for r in s.experiments()] == ["block-size", "block-size"]
        assert s.experiments()[0].rows == result.rows
        assert s.meta.schema_version == 1


def test_saving_into_a_missing_or_foreign_file_is_refused(tmp_path, result):
    with pytest.raises(MissingSessionError, match="no such session file"):
        save_experiment(tmp_path / "none.kvscope", result)
    other = tmp_path / "notes.txt"
    other.write_text("hello " * 100)
    with pytest.raises(NotASessionError, match="not a kvscope session"):
        save_experiment(other, result)
    assert other.read_text() == "hello " * 100
