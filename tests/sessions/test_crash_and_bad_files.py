"""A killed recording leaves a readable prefix; files that are not sessions fail clearly; opening
never modifies a file."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from session_testutil import drive, make_engine, snapshot_digest

from kvscope.sessions import (
    MissingSessionError,
    NewerSchemaError,
    NotASessionError,
    Recorder,
    SessionError,
    SessionReader,
    TruncatedSessionError,
)

HERE = Path(__file__).resolve().parent


def fingerprint(path: Path) -> dict:
    """Bytes and mtime of the file and of its WAL, if any."""
    out = {}
    for p in (path, Path(f"{path}-wal")):
        if p.exists():
            out[p.name] = (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def session_file(tmp_path_factory, tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    path = tmp_path_factory.mktemp("sessions") / "good.kvscope"
    with Recorder(path, engine, keyframe_every=8, keyframe_budget=1.0):  # keyframes at 0, 8, ..
        drive(engine, max_steps=40)
    return path


def test_a_killed_recording_opens_with_a_consistent_prefix(tmp_path, tiny_model_dir):
    path = tmp_path / "killed.kvscope"
    proc = subprocess.Popen([sys.executable, str(HERE / "record_until_killed.py"),
                             str(tiny_model_dir), str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    digests = {}
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            kind, a, *b = line.split()
            if kind == "digest":
                digests[int(a)] = b[0]
            elif int(a) >= 60:  # mid-run: 60 steps committed, the writer still going
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        rest = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
    for line in rest.splitlines():
        kind, a, *b = line.split()
        if kind == "digest":
            digests[int(a)] = b[0]
    before = fingerprint(path)
    assert f"{path.name}-wal" in before  # killed: never finalised
    with SessionReader(path) as s:
        assert not s.meta.complete
        assert s.first_step == 0 and s.last_step >= 59
        assert list(s.step_numbers) == [r.step for r in s.steps()]  # contiguous 0..k
        checked = 0
        for step in s.step_numbers:
            snap = s.snapshot_at(step)
            if step in digests:
                assert snapshot_digest(snap) == digests[step], f"step {step}"
                checked += 1
        assert checked >= 60
        assert s.verify() == []
        assert s.requests()
    assert fingerprint(path) == before


def test_random_bytes_are_not_a_session(tmp_path):
    path = tmp_path / "noise.kvscope"
    path.write_bytes(os.urandom(8192))
    before = fingerprint(path)
    with pytest.raises(NotASessionError, match="not a kvscope session"):
        SessionReader(path)
    assert fingerprint(path) == before


@pytest.mark.parametrize("content", [b"", b"hello", b"SQLite format 3\x00" + b"\x00" * 20])
def test_empty_and_tiny_files(tmp_path, content):
    path = tmp_path / "tiny.kvscope"
    path.write_bytes(content)
    with pytest.raises(SessionError) as info:
        SessionReader(path)
    assert isinstance(info.value, TruncatedSessionError if content.startswith(b"SQLite")
                      else NotASessionError)
    assert path.read_bytes() == content


def test_another_sqlite_database_is_not_a_session(tmp_path):
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE notes (x)")
    conn.commit()
    conn.close()
    before = fingerprint(path)
    with pytest.raises(NotASessionError, match="without kvscope's tables"):
        SessionReader(path)
    assert fingerprint(path) == before


def test_missing_file(tmp_path):
    with pytest.raises(MissingSessionError, match="no such session"):
        SessionReader(tmp_path / "nope.kvscope")


def test_truncated_session(tmp_path, session_file):
    path = tmp_path / "cut.kvscope"
    data = session_file.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    before = fingerprint(path)
    with pytest.raises(TruncatedSessionError, match="truncated"):
        SessionReader(path)
    assert fingerprint(path) == before


def test_newer_schema_version(tmp_path, session_file):
    path = tmp_path / "future.kvscope"
    shutil.copyfile(session_file, path)
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 99")
    conn.execute("UPDATE session SET schema_version = 99")
    conn.commit()
    conn.close()
    before = fingerprint(path)
    with pytest.raises(NewerSchemaError, match="schema version 99.*upgrade kvscope"):
        SessionReader(path)
    assert fingerprint(path) == before


def test_opening_and_replaying_never_modifies_the_file(session_file):
    before = fingerprint(session_file)
    with SessionReader(session_file) as s:
        for step in s.step_numbers:
            s.snapshot_at(step)
        s.requests(), s.events_between(0, s.last_step)
    assert fingerprint(session_file) == before
    assert not Path(f"{session_file}-wal").exists()


def test_damaged_events_are_caught_not_replayed_silently(tmp_path, session_file):
    path = tmp_path / "tampered.kvscope"
    shutil.copyfile(session_file, path)
    conn = sqlite3.connect(path)
    conn.execute("DELETE FROM events WHERE step BETWEEN 2 AND 4")  # inside the first interval
    conn.commit()
    conn.close()
    with SessionReader(path) as s:
        assert s.verify()  # the replay no longer reaches the keyframe at step 8
        s.snapshot_at(8)  # keyframes themselves are intact
