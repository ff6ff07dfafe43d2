"""Record an engine session to a SQLite file on a writer thread that the engine never waits on.

Usage (from whichever thread drives the engine: a script, the CLI, the GUI's worker thread)::

    rec = Recorder("run.kvscope", engine, record_text=False, keyframe_every=64)
    rec.start()            # creates the file and adds a step listener to the engine
    ...                    # engine.step() / engine.generate() / a WorkloadRunner, as usual
    rec.status()           # RecorderStatus: steps written, backlog, lagging, error (any thread)
    rec.close()            # unhooks, flushes, finalises (on the engine's thread, engine idle)

or ``with Recorder(path, engine) as rec: ...``. The engine is not thread-safe, so start() and
close() belong on the thread that steps it (in the GUI: slots of the engine worker); status()
may be polled from anywhere.

How the data gets out of the engine thread cheaply:

- ``start()`` subscribes to the engine's step stream (see kvscope.engine.stream). Right after
  each step, on the engine thread, `_on_update` takes the step's StepUpdate (records, events,
  new requests, finished outputs, computed-token counts, counters); events become plain tuples
  (so the Event objects die young: kept until the next batch they would trigger the garbage
  collector's full collections); every ``keyframe_every`` steps it takes ``engine.pool_state()``
  (plain list copies, ~0.5 ms for 16k blocks, against ~10 ms for ``engine.snapshot()``). One
  item goes on an unbounded queue: about 60 us per step in all. The recorder reads nothing of
  the engine but the stream and its public methods.
- The writer thread wakes every ``flush_interval_s`` (never per step: each wake-up would cost
  the engine a GIL hand-off), turns raw copies into keyframe Snapshots (computed exactly as
  ``KVCacheManager.snapshot`` computes them), packs each step's events into one row, and writes
  the batch in one transaction of a few multi-row statements (WAL mode, synchronous=NORMAL: a
  killed process loses at most the last interval, and the file always opens). About every
  ``checkpoint_interval_s`` it checkpoints the WAL into the main file, so the file alone (copied
  without its ``-wal``) holds all but the last second or so.
- The file appears with its schema complete (written under a temporary name, then renamed), and
  ``PATH.lock`` (see lock.py) keeps a second recorder off the path while this one records.
- Nothing is ever dropped. If the writer falls behind (``lag_steps`` unwritten steps, or a
  commit older than ``lag_s``), ``status().lagging`` turns true, ``lag_episodes`` counts it and
  a warning is logged on ``kvscope.sessions``; the engine keeps going, the backlog stays in
  memory, and ``lagging`` clears once the writer has caught up. If writing fails (disk full),
  ``status().error`` says why, recording stops, and the file keeps every committed step.
- Keyframes are spaced so that their cost (the copy here plus the build on the writer) stays
  under ``keyframe_budget`` of the engine's time: ``keyframe_every`` is the minimum spacing, and
  a keyframe is forced after ``keyframe_max_events`` events to bound the replay of a seek.

Replay exactness rests on every pool mutation emitting an event (see replay.py), so recording
needs ``EngineConfig(record_events=True)`` (the default). Text is stored only with
``record_text=True``; cache salts never (an HMAC under a per-recording random key that is not
stored: equal digests mean equal salts within one file, and say nothing across files).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import hmac
import json
import logging
import os
import platform
import queue
import secrets
import sqlite3
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sqlite_utils

from kvscope.engine.block_hash import ExtraKeys, hash_blocks, root_hash, short_hash
from kvscope.engine.lifecycle import Lifecycles
from kvscope.engine.snapshot import CacheCounters, PoolState, Snapshot
from kvscope.engine.token_text import piece_ends, token_pieces
from kvscope.sessions import schema
from kvscope.sessions.lock import SessionLock

log = logging.getLogger("kvscope.sessions")

_NUM_TOTALS = len(CacheCounters.names())

@dataclass
class RecorderStatus:
    """What the GUI shows about a recording. Safe to read from any thread."""

    path: str
    recording: bool  # started and not closed
    steps_captured: int  # steps handed to the writer
    steps_written: int  # steps committed to the file
    events_captured: int
    events_written: int
    keyframes_written: int
    backlog_steps: int  # captured, not yet committed
    max_backlog_steps: int
    lagging: bool  # the writer is behind (see Recorder docs); nothing is dropped
    lag_episodes: int
    last_commit_age_s: float | None  # seconds since the last commit
    error: str | None  # the writer failed: recording stopped (the file holds what was committed)


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


class Recorder:
    def __init__(self, path: str | os.PathLike, engine, *, record_text: bool = False,
                 keyframe_every: int = 64, keyframe_max_events: int = 20_000,
                 keyframe_budget: float = 0.005, flush_interval_s: float = 0.25,
                 lag_steps: int = 10_000, lag_s: float = 5.0, overwrite: bool = False,
                 checkpoint_interval_s: float = 1.0, raw_hashes: bool = False):
        if keyframe_every < 1:
            raise ValueError("keyframe_every must be >= 1")
        self.path = Path(path)
        self.engine = engine
        self.record_text = record_text
        self.keyframe_every = keyframe_every
        self.keyframe_max_events = keyframe_max_events
        self.keyframe_budget = keyframe_budget
        self.flush_interval_s = flush_interval_s
        self.lag_steps = lag_steps
        self.lag_s = lag_s
        self.overwrite = overwrite
        self.checkpoint_interval_s = checkpoint_interval_s
        self._last_checkpoint = 0.0
        self._replaced = False  # another file took our path while recording
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()  # set by close(): write what is left and stop
        self._thread: threading.Thread | None = None
        self._started = self._closed = False
        self._salt_key = secrets.token_bytes(32)  # never stored: digests only group salts
        self.raw_hashes = raw_hashes
        self._hash_key = secrets.token_bytes(32)  # never stored (see stored_hash)
        self._keyed: dict[int, int] = {}  # writer thread: short hash -> stored value
        # engine-thread state
        self._lifecycles = Lifecycles()  # each unfinished request's status
        self._live: dict[int, object] = {}  # unfinished request -> its last output (or None)
        self._steps_since_kf = 0
        self._events_since_kf = 0
        self._force_kf = True
        self._kf_copy_s = 0.0  # engine-thread cost of the last keyframe's raw copy
        self._kf_build_s = 0.0  # writer-thread CPU to turn it into a stored keyframe
        self._step_s_ema = 0.0
        # counters shared with the writer (plain ints: read anywhere, each written by one thread)
        self._captured = 0
        self._written = 0
        self._events_captured = 0
        self._events_written = 0
        self._keyframes_written = 0
        self._max_backlog = 0
        self._lagging = False
        self._lag_episodes = 0
        self._last_commit = None
        self._error: str | None = None

    # ---------------------------------------------------------------- control
    def __enter__(self) -> Recorder:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> Recorder:
        if self._started:
            raise RuntimeError("the recorder was already started")
        cfg = getattr(self.engine, "config", None)
        if cfg is not None and not getattr(cfg, "record_events", True):
            raise ValueError("recording needs EngineConfig(record_events=True): replaying the "
                             "block pool is driven by the engine's events")
        self._lock = SessionLock.acquire(self.path)
        try:
            self._t0 = time.monotonic()
            self._create()
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("SELECT count(*) FROM session").fetchone()  # opens the sidecars
            self._inodes = {suffix: os.stat(f"{self.path}{suffix}").st_ino
                            for suffix in ("", "-wal", "-shm")}
        except BaseException:
            self._lock.release()
            raise
        self._conn = conn
        self._step_cols = ["step", *[c for c in schema.step_record_columns() if c != "step"]]
        self._started = True
        # queued before the recording started
        self._pending_requests = [self._request_info(r)
                                  for r in self.engine.unfinished_requests()]
        self._thread = threading.Thread(target=self._writer, name="kvscope-recorder",
                                        daemon=True)
        self._thread.start()
        self._hook()
        return self

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

    def close(self) -> RecorderStatus:
        """Stop recording, write everything captured, finalise the file. Call it from the thread
        that drives the engine (or while the engine is idle). Idempotent."""
        if not self._started or self._closed:
            return self.status()
        self._closed = True
        self._unhook()
        # Queued before the recording started with no step since, or after the last step.
        known = set(self._live) | {i.request_id for i in self._pending_requests}
        leftover = self._pending_requests + [self._request_info(r)
                                             for r in self.engine.unfinished_requests()
                                             if r.request_id not in known]
        for info in leftover:
            self._lifecycles.arrive(info.request_id)
            self._live[info.request_id] = None
        self._wake.set()
        self._thread.join()
        if self._error is None:
            try:
                self._finalise(leftover)
            except Exception as e:  # noqa: BLE001 - report, never raise into the caller's loop
                self._fail(e)
        with contextlib.suppress(Exception):
            self._conn.close()
        if self._replaced:
            self._remove_own_sidecars()
        self._lock.release()
        return self.status()

    def _remove_own_sidecars(self) -> None:
        """Our -wal and -shm, left next to a file that replaced ours, would be applied to it by
        the next reader: remove them, but only if they are still ours (same inode)."""
        for suffix in ("-wal", "-shm"):
            name = f"{self.path}{suffix}"
            with contextlib.suppress(OSError):
                if os.stat(name).st_ino == self._inodes[suffix]:
                    os.remove(name)

    def status(self) -> RecorderStatus:
        backlog = self._captured - self._written
        age = None if self._last_commit is None else time.monotonic() - self._last_commit
        return RecorderStatus(str(self.path), self._started and not self._closed,
                              self._captured, self._written, self._events_captured,
                              self._events_written,
                              self._keyframes_written, backlog, self._max_backlog,
                              self._lagging, self._lag_episodes, age, self._error)

    # ------------------------------------------------------------ engine hook
    def _hook(self) -> None:
        self.engine.subscribe(self._on_update)

    def _on_update(self, update) -> None:
        """Subscribed to the step stream: called on the engine thread at the end of each step
        (failed steps included)."""
        if self._closed or self._error is not None:
            return
        try:
            self._capture(update)
        except Exception as e:  # noqa: BLE001 - the engine must never fail because of us
            self._fail(e)

    def _unhook(self) -> None:
        self.engine.unsubscribe(self._on_update)

    # --------------------------------------------------- engine thread: capture
    def _capture(self, u) -> None:
        # Requests queued before start() that no step has run yet arrive here again: once only.
        pending, self._pending_requests = self._pending_requests, []
        queued = {i.request_id for i in pending}
        new = pending + [self._request_info(r) for r in u.new_requests
                         if r.request_id not in queued]
        live, lifecycles = self._live, self._lifecycles
        for info in new:
            lifecycles.arrive(info.request_id, info.parent_id)
            live[info.request_id] = None
        # Turn events into plain tuples here, so the step's Event objects die now: held until
        # the writer's next batch they outlive two garbage-collector generations and trigger
        # full collections (measured with the tiny test model: ~0.1 s every few seconds).
        tuples = schema.event_tuples(u.events)
        for e in u.events:
            if e.request_id in live:
                lifecycles.apply(e)
        finished = []
        for out in u.outputs:
            if out.request_id not in live:
                continue
            life, done = lifecycles.output(out)
            if done:
                del live[out.request_id]
                lifecycles.forget(out.request_id)
                finished.append(self._state_row(out, life.status))
            else:
                live[out.request_id] = out
        wall = u.record.wall_s
        self._step_s_ema = wall if not self._step_s_ema else 0.9 * self._step_s_ema + 0.1 * wall
        self._steps_since_kf += 1
        self._events_since_kf += len(tuples)
        raw = None
        if self._force_kf or self._keyframe_due():
            t = time.perf_counter()
            raw = self.engine.pool_state()
            self._kf_copy_s = time.perf_counter() - t
            self._steps_since_kf = self._events_since_kf = 0
            self._force_kf = False
        why = [schema.explanation_row(u.record.step, e) for e in u.explanations]
        self._queue.put(_Capture([(u.record, tuples)], finished, u.num_computed_tokens,
                                 u.counters.as_tuple(), new, raw, why))
        self._captured += 1
        self._events_captured += len(tuples)
        backlog = self._captured - self._written
        self._max_backlog = max(self._max_backlog, backlog)
        if backlog > self.lag_steps and not self._lagging:
            self._set_lagging(f"{backlog} steps not yet written")

    def _keyframe_due(self) -> bool:
        if self._events_since_kf >= self.keyframe_max_events:
            return True
        if self._steps_since_kf < self.keyframe_every:
            return False
        # Keep keyframes (the copy here, the build on the writer, which holds the GIL) under
        # keyframe_budget of the engine's time.
        budget = self.keyframe_budget * self._step_s_ema * self._steps_since_kf
        return self._kf_copy_s + self._kf_build_s <= budget

    def _request_info(self, r) -> _RequestInfo:
        p = r.params
        params = dict(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k,
                      top_p=p.top_p, n=p.n, ignore_eos=p.ignore_eos, seed=p.seed,
                      num_stop=len(p.stop))
        return _RequestInfo(r.request_id, r.parent_id, r.sample_index, r.arrival_s,
                            len(r.prompt_token_ids), r.cache_salt, params,
                            list(r.prompt_token_ids) if self.record_text else None,
                            list(r.prompt_token_ids))

    def _set_lagging(self, why: str) -> None:
        self._lagging = True
        self._lag_episodes += 1
        log.warning("kvscope recorder is falling behind (%s); nothing is dropped, the backlog "
                    "is kept in memory", why)

    def _fail(self, e: BaseException) -> None:
        if self._error is None:
            self._error = f"{type(e).__name__}: {e}"
            log.error("kvscope recorder stopped: %s (the file keeps every committed step)",
                      self._error, exc_info=e)

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
                row = [getattr(rec, c) for c in self._step_cols]
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
            _insert_rows(conn, "keyframes", list(kf_rows[0]), kf_rows)
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
            for name in ("block_hash", "parent_hash"):
                a = getattr(snap, name)
                setattr(snap, name, np.fromiter(map(key, a.tolist()), np.uint64, len(a)))
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
                    prompt_text=text), ends

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

    def _state_row(self, out, status: str) -> dict:
        """A request's state from its latest RequestOutput."""
        row = _metrics_row(out.metrics)
        row.update(request_id=out.request_id, status=status, finish_reason=out.finish_reason,
                   error=out.error, cached_tokens=out.num_cached_tokens,
                   output_tokens=len(out.token_ids))
        if self.record_text:
            row["output_text"] = out.text
            row["_output_ids"] = out.token_ids  # cut into pieces by the writer: _output_ends
        return row

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
                     (_now_iso(), self._written, self._events_written, json.dumps(stats)))
        conn.execute("COMMIT")
        # A plain rollback-journal file to share; if a reader holds it open, it stays WAL.
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            conn.execute("PRAGMA journal_mode = DELETE")
        except sqlite3.OperationalError as e:
            log.info("session left in WAL mode: %s", e)

    def _session_row(self) -> dict:
        engine = self.engine
        loaded = getattr(engine, "loaded", None)
        cfg = getattr(engine, "config", None)
        config = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else {}
        return dict(id=1, schema_version=schema.SCHEMA_VERSION, kvscope_version=_version(),
                    created_by="kvscope.sessions.Recorder",
                    model_name=getattr(loaded, "name", None),
                    model_fingerprint=getattr(loaded, "fingerprint", None),
                    engine_config=json.dumps(config, default=str),
                    block_size=cfg.block_size, num_blocks=engine.num_blocks,
                    machine=json.dumps(_machine()), device=_device(engine),
                    started_at=_now_iso(), started_unix=time.time(), monotonic_t0=self._t0,
                    record_text=int(self.record_text), keyframe_every=self.keyframe_every,
                    block_hashes="raw" if self.raw_hashes else "keyed",
                    complete=0, num_steps=0, num_events=0)


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


def _metrics_row(m) -> dict:
    return dict(arrival_s=m.arrival_s, first_scheduled_s=m.first_scheduled_s,
                first_token_s=m.first_token_s, finished_s=m.finished_s, queue_s=m.queue_s,
                ttft_s=m.ttft_s, tpot_s=m.tpot_s, e2e_s=m.e2e_s,
                num_preemptions=m.num_preemptions)


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


def _now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvscope")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "unknown"


def _machine() -> dict:
    info = dict(platform=platform.platform(), machine=platform.machine(),
                processor=platform.processor(), cpu_count=os.cpu_count(),
                python=platform.python_version(), sqlite=sqlite3.sqlite_version)
    for mod in ("numpy", "torch", "triton", "transformers"):
        m = sys.modules.get(mod)  # versions of what is loaded; never imports torch
        if m is not None:
            info[mod] = getattr(m, "__version__", "?")
    with contextlib.suppress(Exception):
        import psutil

        info["memory_bytes"] = psutil.virtual_memory().total
    return info


def _device(engine) -> str:
    device = getattr(engine, "device", None)
    text = str(device) if device is not None else "cpu"
    torch = sys.modules.get("torch")
    if torch is not None and getattr(device, "type", None) == "cuda":
        with contextlib.suppress(Exception):
            text += f" ({torch.cuda.get_device_name(device)})"
    return text
