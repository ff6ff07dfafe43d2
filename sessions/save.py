"""Save a copy of a session that is still being recorded. Torch-free."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import sqlite3
import urllib.parse
from pathlib import Path


def save_copy(src: str | os.PathLike, dst: str | os.PathLike) -> int:
    """Copy everything committed to the session `src` so far into `dst` (replaced), closed as a
    complete session file. SQLite's backup reads a consistent state while the recorder writes.
    Returns the number of steps copied."""
    src, dst = Path(src), Path(dst)
    for suffix in ("", "-wal", "-shm", "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(f"{dst}{suffix}")
    uri = "file:" + urllib.parse.quote(str(src.resolve())) + "?mode=ro"
    with contextlib.closing(sqlite3.connect(uri, uri=True)) as s, \
            contextlib.closing(sqlite3.connect(dst)) as d:
        s.backup(d)
        steps = d.execute("SELECT count(*) FROM steps").fetchone()[0]
        d.execute("UPDATE session SET complete = 1, closed_at = ?, num_steps = ? WHERE id = 1",
                  (dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), steps))
        d.commit()
        d.execute("PRAGMA journal_mode = DELETE")
    return steps
