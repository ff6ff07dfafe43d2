"""Session files with malformed metadata, request or step rows: export and replay print one
line naming the field and exit 2; the file is unchanged. A keyframe blob that inflates far
beyond its layout is refused without inflating it."""

from __future__ import annotations

import hashlib
import shutil
import sqlite3
import sys
import tracemalloc
import types
import zlib
from pathlib import Path

import pytest
from hostile_testutil import assert_one_line_error, write_jsonl

from kvscope.app.cli import main as cli
from kvscope.sessions import CorruptSessionError, SessionReader
from kvscope.sessions.schema import decode_keyframe


@pytest.fixture(scope="session")
def recorded(tmp_path_factory, tiny_model) -> Path:
    """A real session: a tiny model's run recorded by `kvscope run --record`."""
    folder = tmp_path_factory.mktemp("hostile_session")
    workload = write_jsonl(folder / "w.jsonl",
                           *({"prompt_ids": [3 + i, 4, 5, 6, 7], "max_tokens": 3}
                             for i in range(3)))
    path = folder / "s.kvscope"
    assert cli.main(["run", "--workload", str(workload), "--model", str(tiny_model),
                     "--no-progress", "--record", str(path)]) == 0
    return path


@pytest.fixture
def session(tmp_path, recorded) -> Path:
    copy = tmp_path / "s.kvscope"
    shutil.copyfile(recorded, copy)
    return copy


def corrupt(path: Path, sql: str) -> None:
    conn = sqlite3.connect(path)
    with conn:
        assert conn.execute(sql).rowcount != 0  # -1 for ALTER TABLE
    conn.execute("PRAGMA journal_mode = DELETE")  # no -wal sidecar left behind
    conn.close()


BAD_ROWS = {  # id -> (SQL, *words the error must contain)
    "engine_config not JSON": ("UPDATE session SET engine_config = '{not json'",
                               "metadata engine_config is not valid JSON"),
    "machine not an object": ("UPDATE session SET machine = '[1, 2]'",
                              "metadata: machine is [1, 2], expected dict"),
    "schema_version NULL": ("UPDATE session SET schema_version = NULL",
                            "metadata: schema_version is None, expected int"),
    "schema_version text": ("UPDATE session SET schema_version = 'one'",
                            "metadata: schema_version is 'one'"),
    "num_blocks text": ("UPDATE session SET num_blocks = 'many'", "metadata: num_blocks"),
    "params not JSON": ("UPDATE requests SET params = '{oops' WHERE request_id = 1",
                        "request 1 params is not valid JSON"),
    "arrival_s NULL": ("UPDATE requests SET arrival_s = NULL WHERE request_id = 2",
                       "request 2: arrival_s is None, expected float"),
    "prompt_tokens text": ("UPDATE requests SET prompt_tokens = 'five' WHERE request_id = 0",
                           "request 0: prompt_tokens is 'five'"),
    "start_s NULL": ("UPDATE steps SET start_s = NULL WHERE step = (SELECT min(step) + 1 "
                     "FROM steps)", ": start_s is None, expected float"),
    "wall_s text": ("UPDATE steps SET wall_s = 'slow' WHERE step = (SELECT max(step) "
                    "FROM steps)", ": wall_s is 'slow'"),
}


@pytest.mark.parametrize("case", BAD_ROWS.values(), ids=BAD_ROWS.keys())
def test_export_and_replay_name_the_damaged_field(kvscope, session, tmp_path, monkeypatch,
                                                  case):
    sql, *words = case
    corrupt(session, sql)
    before = hashlib.sha256(session.read_bytes()).hexdigest()
    gui = types.ModuleType("kvscope.app.window.gui")
    gui.run_gui = lambda **kw: pytest.fail("the window was opened on a damaged session")
    monkeypatch.setitem(sys.modules, "kvscope.app.window.gui", gui)
    out = tmp_path / "trace.json"
    for argv in (["export", session, "--chrome-trace", out], ["replay", session]):
        assert_one_line_error(kvscope(*argv), f"{session}: damaged session", *words)
    assert not out.exists()
    assert hashlib.sha256(session.read_bytes()).hexdigest() == before


def test_the_reader_raises_only_session_errors_for_damaged_rows(session):
    corrupt(session, "UPDATE requests SET params = '[' WHERE request_id = 0")
    with SessionReader(session) as reader, pytest.raises(CorruptSessionError):
        reader.requests()
    corrupt(session, "ALTER TABLE session DROP COLUMN device")
    with pytest.raises(CorruptSessionError, match="the metadata lacks device"):
        SessionReader(session)


def _zeros_stream(size: int) -> bytes:
    z = zlib.compressobj(9)
    chunk = bytes(2**20)
    return b"".join(z.compress(chunk) for _ in range(size // len(chunk))) + z.flush()


def test_a_keyframe_bomb_is_refused_without_inflating_it(session):
    bomb = _zeros_stream(256 * 2**20)  # 256 MiB of zeros in about 250 KiB
    with SessionReader(session) as reader:
        first = reader.keyframe_steps[0]
        good = reader.snapshot_at(first)
    conn = sqlite3.connect(session)
    conn.row_factory = sqlite3.Row
    row = dict(conn.execute("SELECT * FROM keyframes WHERE step = ?", (first,)).fetchone())
    with conn:
        conn.execute("UPDATE keyframes SET state = ? WHERE step = ?", (bomb, first))
    conn.close()
    assert decode_keyframe(row).equals(good)  # the untouched row decodes

    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="does not inflate to the"):
            decode_keyframe({**row, "state": bomb})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20  # bounded by the layout (a few KiB), not the 256 MiB inside
    with SessionReader(session) as reader, pytest.raises(CorruptSessionError,
                                                         match="damaged keyframe"):
        reader.snapshot_at(first)


@pytest.mark.parametrize("blob", [b"\x81\xa4host\xc3", b"\xc1garbage", b"\x93\x01\x02\x03"],
                         ids=["nested", "not msgpack", "a list"])
def test_a_damaged_host_tier_keyframe_is_a_damaged_keyframe(session, blob):
    """The host tier's keyframe (one msgpack blob per keyframe) that is not one: the reader
    says which keyframe is damaged, never a traceback."""
    with SessionReader(session) as reader:
        first = reader.keyframe_steps[0]
    corrupt(session, f"UPDATE keyframes SET host = X'{blob.hex()}' WHERE step = {first}")
    with SessionReader(session) as reader, pytest.raises(CorruptSessionError,
                                                         match="damaged keyframe"):
        reader.snapshot_at(first)
