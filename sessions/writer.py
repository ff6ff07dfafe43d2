"""The recorder's writer thread: everything that turns captured steps into the session file
(see recorder.py for how capture and writing divide the work, and schema.py for the format).

The capture (`Recorder._capture`, on the engine's thread) queues one `_Capture` per step; the
writer thread wakes every flush interval, takes what is queued, and writes it in one
transaction. Block hashes are stored keyed (`stored_hash`) unless the recording asked for raw
ones; cache salts only as digests."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import hmac
import json
import logging
import os
import queue
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sqlite_utils

from kvscope.engine.block_hash import ExtraKeys, hash_blocks, root_hash, short_hash
from kvscope.engine.snapshot import CacheCounters, PoolState, Snapshot
from kvscope.engine.token_text import piece_ends, token_pieces
from kvscope.sessions import schema

log = logging.getLogger("kvscope.sessions")

_NUM_TOTALS = len(CacheCounters.names())


@dataclass
class _RequestInfo:
    request_id: int
    parent_id: int | None
    sample_index: int
    arrival_s: float
    prompt_tokens: int
    cache_salt: str | None
    params: dict
    prompt_ids: list[int] | None  # only with record_text
    tokens: list[int]  # the prompt, hashed into its block chain by the writer, never stored
    cache_breakpoint: int | None = None


@dataclass
class _Capture:
    # (StepRecord, event tuples), oldest first; only the last step is "captured" in full (with
    # nct and totals)
    steps: list[tuple]
    finished: list[dict]  # rows of requests that finished
    nct: dict[int, int]
    totals: tuple[int, ...]
    new_requests: list[_RequestInfo]
    raw: PoolState | None  # a copy of the pool for a keyframe
    explanations: list[tuple]  # rows of the explanations table



class SessionWriter:
    """The recorder's writing half (a base of Recorder): the file's creation, the writer
    thread (`_writer`: a batch of captured steps per flush interval, hashed, packed and
    written in one transaction), checkpoints, and the final rows written at close. It reads
    nothing of the engine but what the capture queued and the engine's public identity
    (tokenizer, cache identity, block size)."""

    def _create(self) -> None:
        """Write the schema and the session row under a temporary name, then move the file into
        place: a reader never sees the path without kvscope's tables."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        for suffix in ("", "-journal"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(f"{tmp}{suffix}")
        try:
            conn = sqlite3.connect(tmp, isolation_level=None)
            try:
                conn.execute(f"PRAGMA application_id = {schema.APPLICATION_ID}")
                conn.execute(f"PRAGMA user_version = {schema.SCHEMA_VERSION}")
                conn.execute("BEGIN")
                schema.create_tables(sqlite_utils.Database(conn), schema.step_record_columns())
                conn.execute(*_insert("session", self._session_row()))
                conn.execute("COMMIT")
            finally:
                conn.close()
        except sqlite3.Error as e:  # e.g. a full disk: an OSError, as for the lock file
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
            raise OSError(f"cannot create {self.path}: {e}") from None
        try:
            if self.overwrite:
                # we hold the lock: sidecars left here belong to a finished or dead recording,
                # and a stale -wal would be applied to the new file
                for suffix in ("-wal", "-shm", "-journal"):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(f"{self.path}{suffix}")
                os.replace(tmp, self.path)
            else:
                _link_new(tmp, self.path)
        except FileExistsError:
            raise FileExistsError(f"{self.path} exists (replace it with --overwrite, or "
                                  "overwrite=True from Python)") from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)

    # ------------------------------------------------------- writer thread
    def _writer(self) -> None:
        # Wake once per interval, not per step: a wake-up per queued item costs the engine a GIL
        # hand-off (and a context switch) every step.
        while True:
            stopping = self._wake.wait(self.flush_interval_s)
            batch = []
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if batch and self._error is None:
                try:
                    self._write(batch)
                    if time.monotonic() - self._last_checkpoint >= self.checkpoint_interval_s:
                        self._checkpoint()
                except Exception as e:  # noqa: BLE001
                    self._fail(e)
                    with contextlib.suppress(Exception):
                        self._conn.execute("ROLLBACK")
            self._check_lag()
            if stopping:
                return

    def _checkpoint(self) -> None:
        """Copy the WAL into the main file, so that the file alone (copied without its -wal, or
        left by a killed process) holds all but the last interval."""
        self._check_same_file()
        self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        self._last_checkpoint = time.monotonic()

    def _check_lag(self) -> None:
        backlog = self._captured - self._written
        age = 0.0 if self._last_commit is None else time.monotonic() - self._last_commit
        if not self._lagging and (backlog > self.lag_steps or (backlog and age > self.lag_s)):
            self._set_lagging(f"{backlog} steps not yet written, last commit {age:.1f} s ago")
        elif self._lagging and backlog <= self.lag_steps // 2 and age <= self.lag_s:
            self._lagging = False
            log.info("kvscope recorder caught up")

    def _write(self, batch: list[_Capture]) -> None:
        req_rows, fin_rows, step_rows, event_rows, kf_rows = [], [], [], [], []
        why_rows = [row for cap in batch for row in cap.explanations]
        num_events = 0
        chain_rows = []
        prompt_ends = []  # (request, prompt token ends): with record_text only
        for cap in batch:
            for info in cap.new_requests:
                row, ends = self._request_row(info)
                req_rows.append(row)
                if ends is not None:
                    prompt_ends.append((info.request_id, ends))
                chain_rows.append((info.request_id, self._chain(info)))
            fin_rows += cap.finished
            last = len(cap.steps) - 1
            for i, (rec, events) in enumerate(cap.steps):
                n = len(events)
                if n:
                    event_rows.append(schema.pack_events(rec.step, self._keyed_events(events)))
                    num_events += n
                row = schema.step_row(rec, self._step_cols)
                if i == last:
                    row += list(cap.totals)
                    row.append(schema.encode_nct(cap.nct))
                else:
                    row += [None] * (_NUM_TOTALS + 1)
                row += [n, int(i == last)]
                step_rows.append(row)
            if cap.raw is not None:
                t = time.thread_time()
                kf_rows.append(schema.encode_keyframe(self._keyframe(cap.raw)))
                self._kf_build_s = time.thread_time() - t
        output_ends = self._output_ends(fin_rows)
        conn = self._conn
        conn.execute("BEGIN")
        # Multi-row statements: sqlite3 hands the GIL back to the engine around every call, so
        # a call per batch rather than per row keeps hand-offs (each a context switch for the
        # engine thread) to a handful per flush.
        if req_rows:
            _insert_rows(conn, "requests", list(req_rows[0]), req_rows)
        if chain_rows:
            _insert_rows(conn, "request_chains", ["request_id", "block_hashes"], chain_rows)
        if fin_rows:  # every row has the same keys
            _insert_rows(conn, "requests", list(fin_rows[0]), fin_rows, upsert="request_id")
        self._insert_text(prompt_ends, output_ends)
        if step_rows:
            cols = self._step_cols + list(schema.TOTALS.values()) + ["nct", "num_events",
                                                                    "captured"]
            _insert_rows(conn, "steps", cols, step_rows)
        if event_rows:
            _insert_rows(conn, "events", schema.EVENT_COLUMNS, event_rows)
        if kf_rows:
            cols = list(dict.fromkeys(c for r in kf_rows for c in r))  # (a tier in some only)
            _insert_rows(conn, "keyframes", cols, [{c: r.get(c) for c in cols} for r in kf_rows])
        if why_rows:
            _insert_rows(conn, "explanations", list(schema.EXPLANATION_COLUMNS), why_rows)
        conn.execute("COMMIT")
        self._last_commit = time.monotonic()
        self._written += len(step_rows)
        self._events_written += num_events
        self._keyframes_written += len(kf_rows)

    def stored_hash(self, short: int) -> int:
        """The value this recording stores for a short block hash: unless ``raw_hashes``, an
        HMAC-SHA256 of it under a random key of this recording that is never stored, cut to 64
        bits (0, "no hash", stays 0). Equal blocks and chains stay equal within the file, but a
        guessed prompt cannot be confirmed by hashing it with the model."""
        if self.raw_hashes or not short:
            return short
        keyed = self._keyed.get(short)
        if keyed is None:
            if len(self._keyed) >= 1 << 20:  # bound the cache of a very long recording
                self._keyed.clear()
            digest = hmac.new(self._hash_key, short.to_bytes(8, "little"), hashlib.sha256)
            keyed = self._keyed[short] = int.from_bytes(digest.digest()[:8], "little") or 1
        return keyed

    def _chain(self, info: _RequestInfo) -> bytes:
        """The prompt's block chain as the engine hashes it (from the tokens the step stream
        carries and the engine's public cache identity), stored as the pool's hashes are."""
        keys = ExtraKeys(getattr(self.engine, "cache_identity", ""), None, info.cache_salt)
        hashes = hash_blocks(root_hash(keys), info.tokens, self.engine.config.block_size)
        return np.fromiter((self.stored_hash(short_hash(h)) for h in hashes), np.uint64,
                           len(hashes)).astype("<u8").tobytes()

    def _keyed_events(self, events: list[tuple]) -> list[tuple]:
        if self.raw_hashes:
            return events
        key = self.stored_hash
        return [e if not e[5] else (*e[:5], tuple(map(key, e[5])), e[6]) for e in events]

    def _keyframe(self, raw: PoolState) -> Snapshot:
        snap = raw.snapshot()
        if not self.raw_hashes:
            key = self.stored_hash
            for pool in snap.tiers():
                for name in ("block_hash", "parent_hash"):
                    a = getattr(pool, name)
                    setattr(pool, name, np.fromiter(map(key, a.tolist()), np.uint64, len(a)))
        return snap

    def _salt_digest(self, salt: str | None) -> str | None:
        if salt is None:
            return None
        return hmac.new(self._salt_key, salt.encode(), hashlib.sha256).hexdigest()[:16]

    def _request_row(self, info: _RequestInfo) -> tuple[dict, bytes | None]:
        """The request's row, and where its prompt tokens' text ends (with record_text)."""
        text = ends = None
        if info.prompt_ids is not None:
            tok = getattr(self.engine, "tokenizer", None)
            if tok is not None:  # cut at token boundaries on this thread, never the engine's
                pieces = token_pieces(tok, info.prompt_ids)
                text, ends = "".join(pieces), schema.encode_ends(piece_ends(pieces))
        return dict(request_id=info.request_id, parent_id=info.parent_id,
                    sample_index=info.sample_index, arrival_s=info.arrival_s,
                    salt_digest=self._salt_digest(info.cache_salt),
                    prompt_tokens=info.prompt_tokens, params=json.dumps(info.params),
                    status="waiting" if info.parent_id is None else "running",
                    prompt_text=text, cache_breakpoint=info.cache_breakpoint), ends

    def _output_ends(self, rows: list[dict]) -> list[tuple[int, bytes]]:
        """Takes the output token ids out of finished rows (see _state_row) and returns where
        each output token's text ends, clipped to the recorded output text (a stop string cuts
        it)."""
        tok = getattr(self.engine, "tokenizer", None)
        out = []
        for row in rows:
            ids = row.pop("_output_ids", None)
            if ids is not None and tok is not None and row.get("output_text") is not None:
                limit = len(row["output_text"])
                ends = [min(e, limit) for e in piece_ends(token_pieces(tok, ids))]
                out.append((row["request_id"], schema.encode_ends(ends)))
        return out

    def _insert_text(self, prompt_ends: list, output_ends: list) -> None:
        if prompt_ends:
            _insert_rows(self._conn, "request_text", ["request_id", "prompt_ends"], prompt_ends,
                         upsert="request_id")
        if output_ends:
            _insert_rows(self._conn, "request_text", ["request_id", "output_ends"], output_ends,
                         upsert="request_id")

    # ------------------------------------------------------------- finalise
    def _check_same_file(self) -> None:
        try:
            inode = os.stat(self.path).st_ino
        except OSError:
            inode = None
        if inode != self._inodes[""]:
            self._replaced = True
            raise RuntimeError(f"{self.path} was removed or replaced by another process while "
                               "recording: what this recorder wrote is not at that path")

    def _finalise(self, leftover: list[_RequestInfo]) -> None:
        self._check_same_file()  # never finalise, checkpoint or delete another file's sidecars
        conn = self._conn
        conn.execute("BEGIN")
        prompt_ends = []
        if leftover:
            rows = []
            for info in leftover:
                row, ends = self._request_row(info)
                rows.append(row)
                if ends is not None:
                    prompt_ends.append((info.request_id, ends))
            _insert_rows(conn, "requests", list(rows[0]), rows)
        # Still running or waiting, or finished after the last step (e.g. cancelled).
        rows = []
        for rid, out in self._live.items():
            status = self._lifecycles.get(rid).status
            out = self.engine.request_output(rid) or out
            if out is None:
                rows.append(dict(request_id=rid, status=status))
            else:
                rows.append(self._state_row(out, "finished" if out.finished else status))
        self._insert_text(prompt_ends, self._output_ends(rows))
        for cols in {tuple(r) for r in rows}:
            same = [r for r in rows if tuple(r) == cols]
            _insert_rows(conn, "requests", list(cols), same, upsert="request_id")
        stats = dataclasses.asdict(self.status())
        stats.pop("path")
        conn.execute("UPDATE session SET closed_at = ?, complete = 1, num_steps = ?, "
                     "num_events = ?, recorder_stats = ? WHERE id = 1",
                     (now_iso(), self._written, self._events_written, json.dumps(stats)))
        conn.execute("COMMIT")
        # A plain rollback-journal file to share; if a reader holds it open, it stays WAL.
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            conn.execute("PRAGMA journal_mode = DELETE")
        except sqlite3.OperationalError as e:
            log.info("session left in WAL mode: %s", e)

def _link_new(src: Path, dst: Path) -> None:
    """Give `src` the name `dst` unless `dst` exists (atomically where hard links work)."""
    try:
        os.link(src, dst)
    except FileExistsError:
        raise
    except OSError:  # a file system without hard links
        if dst.exists():
            raise FileExistsError(dst) from None
        os.replace(src, dst)


def _insert(table: str, row: dict) -> tuple[str, list]:
    return (f"INSERT INTO {table} ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
            list(row.values()))


def _insert_rows(conn, table: str, cols, rows, upsert: str | None = None) -> None:
    """INSERT rows (dicts or sequences in `cols` order) with few statements; with `upsert`,
    rows whose key exists update the given columns instead."""
    cols = list(cols)
    per = max(1, min(500, 30_000 // len(cols)))  # SQLite allows 32,766 parameters
    one = f"({', '.join('?' * len(cols))})"
    tail = ""
    if upsert:
        tail = f" ON CONFLICT({upsert}) DO UPDATE SET " + ", ".join(
            f"{c} = excluded.{c}" for c in cols if c != upsert)
    for i in range(0, len(rows), per):
        chunk = rows[i:i + per]
        values = [r[c] for r in chunk for c in cols] if isinstance(chunk[0], dict) else \
            [v for r in chunk for v in r]
        conn.execute(f"INSERT INTO {table} ({', '.join(cols)}) VALUES "
                     f"{', '.join([one] * len(chunk))}{tail}", values)


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
