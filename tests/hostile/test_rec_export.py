"""`kvscope export` never writes onto its input: the session, its SQLite sidecars, by any name."""

from __future__ import annotations

import os
import time

import pytest
from rec_util import drive, make_engine, rec_model_dir, record  # noqa: F401 - a fixture

from kvscope.app.cli import main as cli
from kvscope.sessions import Recorder


@pytest.fixture(scope="module")
def session(tmp_path_factory, rec_model_dir):  # noqa: F811
    return record(tmp_path_factory.mktemp("export") / "run.kvscope", rec_model_dir)


def refused(argv, files, capsys) -> str:
    before = {f: f.read_bytes() for f in files}
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "refusing" in err
    assert {f: f.read_bytes() for f in files} == before
    return err


def test_the_trace_or_a_csv_path_onto_the_session_is_refused(session, tmp_path, capsys):
    link = tmp_path / "link.kvscope"
    link.symlink_to(session)
    hard = tmp_path / "hard.json"
    os.link(session, hard)
    for out in (session, link, hard, tmp_path / ".." / tmp_path.name / "link.kvscope"):
        refused(["export", str(session), "--chrome-trace", str(out)], [session], capsys)
        refused(["export", str(link), "--chrome-trace", str(out)], [session], capsys)
    # a --csv folder that is the session file, and nothing half-written with a good trace path
    trace = tmp_path / "ok.json"
    refused(["export", str(session), "--chrome-trace", str(trace), "--csv", str(session)],
            [session], capsys)
    assert not trace.exists()


def test_a_csv_folder_holding_the_session_is_fine(tmp_path, rec_model_dir, capsys):  # noqa: F811
    path = record(tmp_path / "requests.csv", rec_model_dir, max_steps=10)
    # requests.csv inside the folder IS the session: refused
    refused(["export", str(path), "--csv", str(tmp_path)], [path], capsys)
    other = record(tmp_path / "b.kvscope", rec_model_dir, max_steps=10)
    assert cli.main(["export", str(other), "--csv", str(tmp_path / "sub"),
                     "--chrome-trace", str(tmp_path / "b.json")]) == 0
    assert (tmp_path / "sub" / "steps.csv").stat().st_size > 0


def test_the_wal_sidecar_of_a_live_recording_is_refused(tmp_path, rec_model_dir, capsys):  # noqa: F811
    engine = make_engine(rec_model_dir)
    path = tmp_path / "live.kvscope"
    with Recorder(path, engine, flush_interval_s=0.01, checkpoint_interval_s=1e9) as rec:
        drive(engine, max_steps=10)
        deadline = time.monotonic() + 10  # all written: the writer leaves the files alone now
        while rec.status().backlog_steps and time.monotonic() < deadline:
            time.sleep(0.01)
        wal = tmp_path / "live.kvscope-wal"
        assert wal.exists() and rec.status().recording
        refused(["export", str(path), "--chrome-trace", str(wal)], [path, wal], capsys)
