"""Errors raised when a session file cannot be read. Each names the problem in one line."""

from __future__ import annotations

import sqlite3
from pathlib import Path


class SessionError(Exception):
    """A session file cannot be opened or replayed. The message is one line for the user."""


class MissingSessionError(SessionError, FileNotFoundError):
    """The path does not exist (or is not a file)."""


class NotASessionError(SessionError):
    """The file is not a kvscope session (not SQLite, or SQLite without kvscope's tables)."""


class CorruptSessionError(SessionError):
    """The file is a kvscope session, but its content is damaged."""


class TruncatedSessionError(CorruptSessionError):
    """The file is shorter than its own header says: it was cut off (e.g. a partial copy)."""


class NewerSchemaError(SessionError):
    """The session was written by a newer kvscope, with a schema version this one cannot read."""


class ReplayError(CorruptSessionError):
    """Replaying the recorded events does not reproduce a consistent block pool."""


def db_error(path: Path, e: sqlite3.DatabaseError) -> SessionError:
    """The SessionError for an SQLite error met while reading `path`."""
    msg = str(e)
    if "file is not a database" in msg:
        return NotASessionError(f"{path}: not a kvscope session (not an SQLite database)")
    if "malformed" in msg or "corrupt" in msg:
        return CorruptSessionError(f"{path}: damaged session ({msg})")
    return SessionError(f"{path}: cannot read the session ({msg})")
