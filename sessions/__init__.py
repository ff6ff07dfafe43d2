"""Sessions: record an engine run to a SQLite file, replay any step, export it. No Qt, no torch.

    from kvscope.sessions import Recorder, SessionReader, export_chrome_trace, export_csv
"""

from kvscope.sessions.errors import (
    CorruptSessionError,
    MissingSessionError,
    NewerSchemaError,
    NotASessionError,
    ReplayError,
    SessionError,
    TruncatedSessionError,
)
from kvscope.sessions.export import chrome_trace, export_chrome_trace, export_csv
from kvscope.sessions.reader import RecordedRequest, SessionMeta, SessionReader
from kvscope.sessions.recorder import Recorder, RecorderStatus
from kvscope.sessions.schema import SCHEMA_VERSION, SUFFIX
from kvscope.sessions.seek import Frame

__all__ = ["SCHEMA_VERSION", "SUFFIX", "CorruptSessionError", "Frame", "MissingSessionError",
           "NewerSchemaError", "NotASessionError", "RecordedRequest", "Recorder",
           "RecorderStatus", "ReplayError", "SessionError", "SessionMeta", "SessionReader",
           "TruncatedSessionError", "chrome_trace", "export_chrome_trace", "export_csv"]
