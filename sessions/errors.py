"""Errors raised when a session file cannot be read. Each names the problem in one line."""

from __future__ import annotations


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
