"""Experiment results kept in a session file, so a recorded session replays them. Torch-free.

One optional table, ``experiments``: a row per result (name, model, when, the result as JSON).
It is created on the first save, so files of any schema version hold it or not; a file without
it has no experiments. Saving while a recording writes the same file is safe: SQLite serialises
the two writers (the recorder keeps the file in WAL mode).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import sqlite3
from pathlib import Path

from kvscope.lab.experiments.result import Result
from kvscope.sessions import schema
from kvscope.sessions.errors import CorruptSessionError, MissingSessionError, NotASessionError

CREATE = ("CREATE TABLE IF NOT EXISTS experiments (id INTEGER PRIMARY KEY, name TEXT NOT NULL, "
          "model TEXT, finished_at TEXT, result TEXT NOT NULL)")


def save_experiment(path: str | os.PathLike, result: Result) -> int:
    """Append a result to the session at `path`; returns its row id."""
    p = Path(path)
    if not p.is_file():
        raise MissingSessionError(f"{p}: no such session file")
    try:
        with contextlib.closing(sqlite3.connect(p, timeout=10)) as conn:
            if conn.execute("PRAGMA application_id").fetchone()[0] != schema.APPLICATION_ID:
                raise NotASessionError(f"{p}: not a kvscope session")
            with conn:
                conn.execute(CREATE)
                cur = conn.execute(
                    "INSERT INTO experiments (name, model, finished_at, result) "
                    "VALUES (?, ?, ?, ?)",
                    (result.name, result.model,
                     dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                     json.dumps(result.to_dict())))
            return cur.lastrowid
    except sqlite3.DatabaseError as e:
        raise NotASessionError(f"{p}: not a kvscope session ({e})") from None


def load_experiments(conn: sqlite3.Connection, where: Path) -> list[Result]:
    """The results saved in an open session, oldest first."""
    if not conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND "
                        "name = 'experiments'").fetchall():
        return []
    out = []
    for (text,) in conn.execute("SELECT result FROM experiments ORDER BY id"):
        try:
            out.append(Result.from_dict(json.loads(text)))
        except (TypeError, ValueError) as e:
            raise CorruptSessionError(f"{where}: damaged experiment result: {e}") from None
    return out
