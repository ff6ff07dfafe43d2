"""Open a recorded session read-only and replay any step. Torch-free.

    with SessionReader("run.kvscope") as s:
        s.meta.model_name, s.first_step, s.last_step
        s.requests()                 # list[RecordedRequest]
        s.steps()                    # list[StepRecord], as the engine produced them
        s.snapshot_at(120)           # Snapshot, equal to the live engine's at the end of step 120
        s.events_between(100, 120)   # list[Event] published by steps 100..120
        for frame in s.playback(100, 200): ...   # (record, events, snapshot), incrementally

The file is never modified: it is opened with ``mode=ro`` (a session still being written, or left
by a killed recorder, is in WAL mode; SQLite reads its WAL without writing the database file).
Problems raise a `SessionError` subclass naming the problem.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import tempfile
import urllib.parse
from collections import OrderedDict
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import numpy as np

from kvscope.engine import policies
from kvscope.engine.config import shown
from kvscope.engine.events import Event
from kvscope.engine.metrics import StepRecord
from kvscope.sessions import schema
from kvscope.sessions.errors import (
    CorruptSessionError,
    MissingSessionError,
    NewerSchemaError,
    NotASessionError,
    SessionError,
    TruncatedSessionError,
    db_error,
)
from kvscope.sessions.lock import holder
from kvscope.sessions.replay import PoolReplay
from kvscope.sessions.seek import Seeking

SQLITE_MAGIC = b"SQLite format 3\x00"
_COLUMN_TYPES = {"int": int, "float": (int, float), "bool": int, "str": str, "dict": dict,
                 "tuple[int, ...]": tuple}


@dataclass
class SessionMeta:
    schema_version: int
    kvscope_version: str
    model_name: str | None
    model_fingerprint: str | None
    engine_config: dict
    block_size: int
    num_blocks: int
    machine: dict
    device: str
    started_at: str
    monotonic_t0: float  # the recording's time origin (time.monotonic of the recording process)
    record_text: bool
    keyframe_every: int
    complete: bool  # closed cleanly; False for a session cut short (e.g. a killed process)
    closed_at: str | None
    recorder_stats: dict | None
    # the KV cache's bytes per token (every layer, K and V; a fraction for a sub-byte format);
    # None: not known (a file from before it was kept, or an engine that does not say):
    # transfers in blocks only
    kv_bytes_per_token: float | None = None

    @property
    def block_bytes(self) -> int | None:
        """A block's KV bytes (what a host-tier copy of it moves); None: not known."""
        per_token = self.kv_bytes_per_token
        return round(per_token * self.block_size) if per_token else None


@dataclass
class RecordedRequest:
    request_id: int
    parent_id: int | None
    sample_index: int
    arrival_s: float
    salt_digest: str | None  # equal digests = equal salts, within this session only
    prompt_tokens: int
    cached_tokens: int | None
    output_tokens: int | None
    params: dict
    status: str  # waiting | running | finished (what was known when the recording stopped)
    finish_reason: str | None
    error: str | None
    first_scheduled_s: float | None
    first_token_s: float | None
    finished_s: float | None
    queue_s: float | None
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    num_preemptions: int | None
    prompt_text: str | None
    output_text: str | None
    cache_breakpoint: int | None = None  # tokens an API would cache (files from before: None)


class SessionReader(Seeking):
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._tmpdir = None
        self._conn = self._open()
        try:
            self._load_index()
        except sqlite3.DatabaseError as e:
            self.close()
            raise db_error(self.path, e) from e
        except BaseException:
            self.close()
            raise
        self._cursor: PoolReplay | None = None
        # Replays at keyframes (and halfway to the next), never advanced: a seek copies one
        # rather than decoding the keyframe and rebuilding its pool (most recently used last;
        # bounded in blocks).
        self._at_keyframe: OrderedDict[int, PoolReplay] = OrderedDict()

    # ------------------------------------------------------------------ open
    def _open(self) -> sqlite3.Connection:
        p = self.path
        if not p.is_file():
            if holder(p) is not None:
                raise SessionError(f"{p}: the session is still being created; open it again "
                                   "in a moment")
            raise MissingSessionError(f"{p}: no such session file")
        size = p.stat().st_size
        with open(p, "rb") as f:
            header = f.read(100)
        wal = Path(f"{p}-wal")
        has_wal = wal.is_file() and wal.stat().st_size > 0
        if not header.startswith(SQLITE_MAGIC[:len(header)]) or (not header and not has_wal):
            raise _unreadable(p, header, has_wal, "not an SQLite database")
        if len(header) < 100:
            raise TruncatedSessionError(f"{p}: truncated ({size} bytes, shorter than the "
                                        "SQLite header)")
        page_size = int.from_bytes(header[16:18], "big")
        page_size = 65536 if page_size == 1 else page_size
        pages = int.from_bytes(header[28:32], "big")
        valid_for = int.from_bytes(header[92:96], "big")
        change = int.from_bytes(header[24:28], "big")
        if not has_wal and pages and valid_for == change and size < pages * page_size:
            raise TruncatedSessionError(
                f"{p}: truncated: {size} bytes, but its header says {pages} pages of "
                f"{page_size} bytes ({pages * page_size} bytes)")
        try:
            try:
                conn = self._connect(p)
            except sqlite3.OperationalError:
                # e.g. a WAL-mode file in a read-only folder: SQLite cannot create its -shm
                conn = self._connect_copy(p, has_wal)
        except sqlite3.DatabaseError as e:
            raise _unreadable(p, header, has_wal, e) from e
        try:
            app_id = conn.execute("PRAGMA application_id").fetchone()[0]
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            tables = {r[0] for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.DatabaseError as e:
            conn.close()
            raise _unreadable(p, header, has_wal, e) from e
        if app_id != schema.APPLICATION_ID or "session" not in tables:
            conn.close()
            raise _unreadable(p, header, has_wal, "an SQLite database without kvscope's tables")
        missing = {"requests", "steps", "events", "keyframes"} - tables
        if version > schema.SCHEMA_VERSION:
            conn.close()
            raise NewerSchemaError(f"{p}: written with session schema version {version}; this "
                                   f"kvscope reads versions up to {schema.SCHEMA_VERSION} "
                                   "(upgrade kvscope)")
        if missing:
            conn.close()
            raise CorruptSessionError(f"{p}: damaged session: missing tables "
                                      f"{', '.join(sorted(missing))}")
        return conn

    @staticmethod
    def _connect(p: Path) -> sqlite3.Connection:
        uri = "file:" + urllib.parse.quote(str(p.resolve())) + "?mode=ro"
        conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
        conn.execute("PRAGMA query_only = 1")
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()  # fail now, not later
        return conn

    def _connect_copy(self, p: Path, has_wal: bool) -> sqlite3.Connection:
        self._tmpdir = tempfile.TemporaryDirectory(prefix="kvscope-session-")
        copy = Path(self._tmpdir.name) / "session.kvscope"
        shutil.copyfile(p, copy)
        if has_wal:
            shutil.copyfile(f"{p}-wal", f"{copy}-wal")
        return self._connect(copy)

    def _load_index(self) -> None:
        conn = self._conn
        conn.row_factory = sqlite3.Row
        row = conn.execute("SELECT * FROM session WHERE id = 1").fetchone()
        conn.row_factory = None
        if row is None:
            raise CorruptSessionError(f"{self.path}: damaged session: no metadata row")
        columns = row.keys()  # (`in row` would search the values of a sqlite3.Row)
        missing = [f.name for f in fields(SessionMeta)
                   if f.name not in columns and f.default is MISSING]
        if missing:
            raise CorruptSessionError(f"{self.path}: damaged session: the metadata lacks "
                                      f"{', '.join(missing)}")
        d = {f.name: row[f.name] for f in fields(SessionMeta) if f.name in columns}
        d["engine_config"] = self._json(d["engine_config"] or "{}", "metadata engine_config")
        d["machine"] = self._json(d["machine"] or "{}", "metadata machine")
        if d["recorder_stats"]:
            d["recorder_stats"] = self._json(d["recorder_stats"], "metadata recorder_stats")
        self._check_types(SessionMeta, d, "metadata")
        if d["schema_version"] > schema.SCHEMA_VERSION:
            raise NewerSchemaError(
                f"{self.path}: written with session schema version {d['schema_version']}; "
                f"this kvscope reads versions up to {schema.SCHEMA_VERSION} (upgrade kvscope)")
        d["record_text"], d["complete"] = bool(d["record_text"]), bool(d["complete"])
        self.meta = SessionMeta(**d)
        config = self.meta.engine_config
        self._policy = config.get("eviction_policy", "lru")
        self._host_policy = config.get("host_eviction_policy", "lru")  # (before host tiers)
        for policy in (self._policy, self._host_policy):
            if policies.check(policy):
                raise CorruptSessionError(f"{self.path}: damaged session: unknown eviction "
                                          f"policy {shown(policy)} in the metadata")
        index = conn.execute("SELECT step, captured FROM steps ORDER BY step").fetchall()
        self._steps = [r[0] for r in index]
        self._captured = {r[0] for r in index if r[1]}
        if self._steps and self._steps[-1] - self._steps[0] + 1 != len(self._steps):
            raise CorruptSessionError(f"{self.path}: damaged session: steps are not contiguous")
        self.keyframe_steps = [r[0] for r in conn.execute(
            "SELECT step FROM keyframes ORDER BY step")]
        self._step_columns = [r[1] for r in conn.execute("PRAGMA table_info(steps)")]

    @property
    def block_hashes(self) -> str:
        """How the file stores block hashes: "keyed" (an HMAC under a key of the recording that
        is not stored: chains and sharing are kept within the file, nothing compares across
        files) or "raw" (the engine's short hashes; files written before this choice)."""
        cols = {r[1] for r in self._query("PRAGMA table_info(session)")}
        if "block_hashes" not in cols:
            return "raw"
        return self._query("SELECT block_hashes FROM session WHERE id = 1")[0][0] or "raw"

    def refresh(self) -> None:
        """Re-read the index: a session still being recorded has grown since it was opened."""
        try:
            self._load_index()
        except sqlite3.DatabaseError as e:
            raise db_error(self.path, e) from e

    def close(self) -> None:
        if getattr(self, "_conn", None) is not None:
            self._conn.close()
            self._conn = None
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def __enter__(self) -> SessionReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- tables
    @property
    def num_steps(self) -> int:
        return len(self._steps)

    @property
    def first_step(self) -> int | None:
        return self._steps[0] if self._steps else None

    @property
    def last_step(self) -> int | None:
        return self._steps[-1] if self._steps else None

    @property
    def step_numbers(self) -> range:
        return range(self.first_step, self.last_step + 1) if self._steps else range(0)

    def _request_columns(self) -> list[str]:
        """RecordedRequest's fields as SELECT columns (NULL for one a file from before lacks)."""
        have = {r[1] for r in self._query("PRAGMA table_info(requests)")}
        return [f.name if f.name in have else "NULL" for f in fields(RecordedRequest)]

    def requests(self) -> list[RecordedRequest]:
        names = [f.name for f in fields(RecordedRequest)]
        rows = self._query(f"SELECT {', '.join(self._request_columns())} FROM requests "
                           "ORDER BY request_id")
        out = []
        for r in rows:
            d = dict(zip(names, r, strict=True))
            where = f"request {d['request_id']}"
            d["params"] = self._json(d["params"] or "{}", f"{where} params")
            self._check_types(RecordedRequest, d, where)
            out.append(RecordedRequest(**d))
        return out

    def request(self, request_id: int) -> RecordedRequest | None:
        """One request's row (None: not in the file)."""
        names = [f.name for f in fields(RecordedRequest)]
        rows = self._query(f"SELECT {', '.join(self._request_columns())} FROM requests "
                           "WHERE request_id = ?", (request_id,))
        if not rows:
            return None
        d = dict(zip(names, rows[0], strict=True))
        d["params"] = self._json(d["params"] or "{}", f"request {request_id} params")
        self._check_types(RecordedRequest, d, f"request {request_id}")
        return RecordedRequest(**d)

    def token_ends(self, request_id: int) -> tuple[list[int] | None, list[int] | None]:
        """Where each prompt and output token's text ends in the recorded prompt_text and
        output_text (None: not recorded: no text, or a file from before token ends were kept)."""
        if not self._query("SELECT 1 FROM sqlite_master WHERE type = 'table' AND "
                           "name = 'request_text'"):
            return None, None
        rows = self._query("SELECT prompt_ends, output_ends FROM request_text WHERE "
                           "request_id = ?", (request_id,))
        if not rows:
            return None, None
        try:
            return schema.decode_ends(rows[0][0]), schema.decode_ends(rows[0][1])
        except ValueError as e:  # a blob that is not whole uint32s
            raise SessionError(f"{self.path}: request {request_id}: bad token ends: {e}") from e

    def request_chains(self) -> dict[int, np.ndarray]:
        """Each request's prompt block chain (stored hashes, uint64), for the cache lab."""
        if not self._query("SELECT 1 FROM sqlite_master WHERE type = 'table' AND "
                           "name = 'request_chains'"):
            raise SessionError(f"{self.path}: recorded before kvscope kept each request's "
                               "block-hash chain, so the lab cannot replay it")
        return {rid: np.frombuffer(blob or b"", dtype="<u8").astype(np.uint64)
                for rid, blob in self._query("SELECT request_id, block_hashes FROM "
                                             "request_chains")}

    def steps(self, first: int | None = None, last: int | None = None) -> list[StepRecord]:
        """The engine's StepRecords (fields this kvscope does not know are ignored)."""
        known = [f for f in fields(StepRecord) if f.name in self._step_columns]
        lo = self.first_step if first is None else first
        hi = self.last_step if last is None else last
        if lo is None:
            return []
        rows = self._query(f"SELECT {', '.join(f.name for f in known)} FROM steps "
                           "WHERE step BETWEEN ? AND ? ORDER BY step", (lo, hi))
        bools = [f.name for f in known if str(f.type) == "bool"]
        out = []
        tuples = [name for name in schema.STEP_TUPLES if name in self._step_columns]
        for r in rows:
            d = dict(zip((f.name for f in known), r, strict=True))
            for name in tuples:
                try:
                    d[name] = schema.decode_step_tuple(d[name])
                except (ValueError, AttributeError):
                    raise CorruptSessionError(f"{self.path}: damaged session: step {d['step']}: "
                                              f"{name} is {shown(d[name])}, expected whole "
                                              "numbers") from None
            self._check_types(StepRecord, d, f"step {d['step']}")
            for b in bools:
                d[b] = bool(d[b])
            out.append(StepRecord(**d))
        return out

    def _json(self, text, where: str):
        try:
            return json.loads(text)
        except (ValueError, TypeError, RecursionError):
            raise CorruptSessionError(f"{self.path}: damaged session: {where} is not valid "
                                      "JSON") from None

    def _check_types(self, cls, values: dict, where: str) -> None:
        """Refuse a row whose values lack the types `cls` declares (NULL where a value is
        required, text where a number is), naming the field."""
        for f in fields(cls):
            if f.name not in values:
                continue
            v, kinds = values[f.name], str(f.type).split(" | ")
            if v is None and "None" in kinds:
                continue
            if not any(isinstance(v, _COLUMN_TYPES.get(k, ())) and not isinstance(v, bool)
                       for k in kinds):
                raise CorruptSessionError(f"{self.path}: damaged session: {where}: {f.name} is "
                                          f"{shown(v)}, expected {f.type}")

    def step_table(self) -> tuple[list[str], list[tuple]]:
        """Every column of the steps table except the internal ones: (names, rows)."""
        cols = [c for c in self._step_columns if c not in ("nct", "captured")]
        return cols, self._query(f"SELECT {', '.join(cols)} FROM steps ORDER BY step")

    def events_between(self, first: int, last: int) -> list[Event]:
        """Events published by steps first..last (inclusive), in order. An event's own `step` is
        the step the engine stamped on it (one step earlier for a cancel between steps)."""
        try:
            return [schema.event_of(*e) for _, e in self._events(first, last)]
        except ValueError as e:  # a kind this kvscope does not know
            raise CorruptSessionError(f"{self.path}: damaged events in steps {first}..{last}: "
                                      f"{e}") from e

    def events_at(self, step: int) -> list[Event]:
        return self.events_between(step, step)

    def events_published(self, first: int, last: int, kinds=None) -> list[tuple[int, Event]]:
        """(the step that published it, event) for the events of steps first..last, optionally
        only those of some kinds (one query: cheap for a whole session)."""
        try:
            return [(s, schema.event_of(*e)) for s, e in self._events(first, last, kinds)]
        except ValueError as e:  # a kind this kvscope does not know
            raise CorruptSessionError(f"{self.path}: damaged events in steps {first}..{last}: "
                                      f"{e}") from e

    def _events(self, first: int, last: int, kinds=None) -> list[tuple[int, tuple]]:
        """(published step, event tuple) pairs, optionally only of some kinds."""
        rows = self._query(f"SELECT {', '.join(schema.EVENT_COLUMNS)} FROM events "
                           "WHERE step BETWEEN ? AND ? ORDER BY step", (first, last))
        out = []
        try:
            for row in rows:
                out += [(row[0], e) for e in schema.unpack_events(row, kinds)]
        except (ValueError, IndexError, TypeError) as e:
            raise CorruptSessionError(f"{self.path}: damaged events in steps {first}..{last}: "
                                      f"{e}") from e
        return out

    def explanation(self, request_id: int, step: int | None = None):
        """Why a request missed the prefix cache, as the engine explained it at its latest
        admission at or before `step` (a MissExplanation; None if it was not admitted by then,
        or the file predates schema version 2, which added explanations)."""
        has_table = self._query("SELECT 1 FROM sqlite_master WHERE type = 'table' AND "
                                "name = 'explanations'")
        if not has_table:
            return None
        have = {r[1] for r in self._query("PRAGMA table_info(explanations)")}
        cols = [c if c in have else "NULL" for c in schema.EXPLANATION_COLUMNS]
        rows = self._query(f"SELECT {', '.join(cols)} FROM explanations "
                           "WHERE request_id = ? AND step <= ? ORDER BY step DESC LIMIT 1",
                           (request_id, self.last_step if step is None else step))
        return schema.explanation_from_row(rows[0]) if rows else None

    def experiments(self) -> list:
        """The experiment results saved in this session (kvscope.lab.experiments.Result),
        oldest first; none in a file that never had one."""
        from kvscope.sessions.experiments import load_experiments

        try:
            return load_experiments(self._conn, self.path)
        except sqlite3.DatabaseError as e:
            raise db_error(self.path, e) from e

    def _query(self, sql: str, args=()) -> list[tuple]:
        try:
            return self._conn.execute(sql, args).fetchall()
        except sqlite3.DatabaseError as e:
            raise db_error(self.path, e) from e


def _unreadable(p: Path, header: bytes, has_wal: bool, why) -> SessionError:
    """The error for a file that does not open as a session, naming the likelier cause when a
    recording is creating it or its WAL sidecar is missing or foreign."""
    if holder(p) is not None:
        return SessionError(f"{p}: the session is still being created; open it again in a "
                            "moment")
    if header[18:20] == b"\x02\x02":  # WAL mode: recent pages may live only in PATH-wal
        wal = Path(f"{p}-wal")
        if not has_wal:  # (checked before SQLite opened it: that creates an empty one)
            return CorruptSessionError(
                f"{p}: unreadable, and its sidecar {wal.name} is missing (a recording still "
                "running or killed keeps its latest data there: copy it along with the file)")
        return CorruptSessionError(f"{p}: unreadable with the sidecar {wal.name} next to it "
                                   "(is it stale, left by another recording?)")
    if isinstance(why, sqlite3.DatabaseError):
        return db_error(p, why)
    return NotASessionError(f"{p}: not a kvscope session ({why})")
