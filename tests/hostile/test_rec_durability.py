"""Nothing recorded is lost: the main file alone holds a killed recording (checkpoints), a missing
WAL sidecar or a session still being created is named as such, and one recorder per path."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest
from rec_util import TESTS, drive, make_engine, rec_model_dir, record  # noqa: F401 - a fixture

from kvscope.sessions import NotASessionError, Recorder, SessionError, SessionReader
from kvscope.sessions.lock import RecordingInProgressError


def test_the_main_file_alone_holds_a_killed_recording(tmp_path, rec_model_dir):  # noqa: F811
    path = tmp_path / "killed.kvscope"
    proc = subprocess.Popen([sys.executable, str(TESTS / "sessions" / "record_until_killed.py"),
                             str(rec_model_dir), str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    written = []  # (time, steps committed)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            kind, a, *_ = line.split()
            if kind == "written" and int(a):
                written.append((time.monotonic(), int(a)))
                if time.monotonic() - written[0][0] > 4.0:
                    break
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
    killed_at = time.monotonic()
    # committed at least 2.5 s before the kill: checkpointed (every second) into the main file
    old = max(n for t, n in written if t <= killed_at - 2.5)
    assert old >= 10
    alone = tmp_path / "copy" / "killed.kvscope"
    alone.parent.mkdir()
    shutil.copyfile(path, alone)  # as users copy it: without the -wal
    with SessionReader(alone) as s:
        assert not s.meta.complete
        assert s.num_steps >= old
        assert s.verify() == []
    # the dead recorder's lock is taken over
    assert (tmp_path / "killed.kvscope.lock").read_text() == str(proc.pid)
    record(path, rec_model_dir, max_steps=5, overwrite=True)
    assert not (tmp_path / "killed.kvscope.lock").exists()
    with SessionReader(path) as s:
        assert s.meta.complete and s.num_steps == 5


def test_a_missing_wal_sidecar_is_named(tmp_path):
    path = tmp_path / "w.kvscope"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("CREATE TABLE session (id INTEGER)")  # only in the WAL: never checkpointed
    copy = tmp_path / "copy.kvscope"
    shutil.copyfile(path, copy)
    conn.close()
    with pytest.raises(SessionError, match="copy.kvscope-wal is missing") as e:
        SessionReader(copy)
    assert "not a kvscope session" not in str(e.value)


def test_a_session_being_created_is_not_called_not_a_session(tmp_path, rec_model_dir):  # noqa: F811
    engine = make_engine(rec_model_dir)
    paths = [tmp_path / f"s{i}.kvscope" for i in range(15)]
    errors, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            for p in paths:
                try:
                    SessionReader(p).close()
                except NotASessionError as e:
                    errors.append(str(e))
                except SessionError:
                    pass  # missing, or "still being created"

    t = threading.Thread(target=poll)
    t.start()
    try:
        for p in paths:
            Recorder(p, engine).start().close()
    finally:
        stop.set()
        t.join()
    assert errors == []
    for p in paths:  # every one is a complete session now
        with SessionReader(p) as s:
            assert s.meta.complete
    # the lock of a live recorder with nothing on disk yet
    (tmp_path / "new.kvscope.lock").write_text(str(os.getpid()))
    with pytest.raises(SessionError, match="still being created"):
        SessionReader(tmp_path / "new.kvscope")


def test_one_recorder_per_path(tmp_path, rec_model_dir):  # noqa: F811
    path = tmp_path / "one.kvscope"
    first, second = make_engine(rec_model_dir), make_engine(rec_model_dir)
    rec = Recorder(path, first, flush_interval_s=0.01).start()
    drive(first, max_steps=10)
    for overwrite in (False, True):
        with pytest.raises(RecordingInProgressError, match=f"process {os.getpid()}"):
            Recorder(path, second, overwrite=overwrite).start()
    drive(first, max_steps=10, seed=1)
    status = rec.close()
    assert status.error is None and status.steps_written == 20
    with SessionReader(path) as s:
        assert s.num_steps == 20 and s.meta.complete
    # once it is closed, the path is free again
    record(path, rec_model_dir, max_steps=3, overwrite=True)


def test_a_recorder_whose_file_was_replaced_reports_it_and_leaves_it_alone(tmp_path,
                                                                           rec_model_dir):  # noqa: F811
    path = tmp_path / "r.kvscope"
    other = record(tmp_path / "other.kvscope", rec_model_dir, max_steps=4)
    engine = make_engine(rec_model_dir)
    rec = Recorder(path, engine, flush_interval_s=0.01).start()
    drive(engine, max_steps=10)
    os.replace(other, path)  # someone else's file now has this name
    before = path.read_bytes()
    status = rec.close()
    assert status.error and "replaced" in status.error
    assert path.read_bytes() == before
    with SessionReader(path) as s:
        assert s.num_steps == 4
