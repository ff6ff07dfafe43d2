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

- ``start()`` subscribes to the engine (one queue put per step) and wraps this engine
  instance's ``step`` (engine.generate, a WorkloadRunner, the GUI worker all go through it).
  Right after each step, on the engine thread, `_after_step` takes the step's update and what
  events do not carry: each live request's computed-token count and six running totals of the
  cache manager; events become plain tuples (so the Event objects die young: kept until the
  next batch they would trigger the garbage collector's full collections); every
  ``keyframe_every`` steps it takes a *raw* copy of the pool (plain list copies, ~0.5 ms for 16k
  blocks, against ~10 ms for ``engine.snapshot()``). One item goes on an unbounded queue: about
  60 us per step in all.
- The writer thread wakes every ``flush_interval_s`` (never per step: each wake-up would cost
  the engine a GIL hand-off), turns raw copies into keyframe Snapshots (computed exactly as
  ``KVCacheManager.snapshot`` computes them), packs each step's events into one row, and writes
  the batch in one transaction of a few multi-row statements (WAL mode, synchronous=NORMAL: a
  killed process loses at most the last interval, and the file always opens).
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
import itertools
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
from types import SimpleNamespace

import numpy as np
import sqlite_utils

from kvscope.engine import events as ev
from kvscope.engine.snapshot import Snapshot
from kvscope.sessions import schema
from kvscope.sessions.replay import build_snapshot
from kvscope.sessions.schema import TOTALS

log = logging.getLogger("kvscope.sessions")

_TERMINAL = frozenset((ev.FINISHED, ev.CANCELLED, ev.REJECTED))

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


@dataclass
class _Capture:
    # (StepRecord, event tuples), oldest first; only the last step is "captured" in full (with
    # nct and totals)
    steps: list[tuple]
    finished: list[dict]  # rows of requests that finished
    nct: dict[int, int]
    totals: tuple[int, ...]
    new_requests: list[_RequestInfo]
    raw: SimpleNamespace | None  # a raw pool copy for a keyframe
    explanations: list[tuple]  # rows of the explanations table


class Recorder:
    def __init__(self, path: str | os.PathLike, engine, *, record_text: bool = False,
                 keyframe_every: int = 64, keyframe_max_events: int = 20_000,
                 keyframe_budget: float = 0.005, flush_interval_s: float = 0.25,
                 lag_steps: int = 10_000, lag_s: float = 5.0, overwrite: bool = False):
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
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()  # set by close(): write what is left and stop
        self._thread: threading.Thread | None = None
        self._started = self._closed = False
        self._salt_key = secrets.token_bytes(32)  # never stored: digests only group salts
        # engine-thread state
        self._next_rid = 0
        self._num_seen = 0
        self._reported: set[int] = set()  # requests whose final row is written
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
        if self.path.exists():
            if not self.overwrite:
                raise FileExistsError(f"{self.path} exists (pass overwrite=True to replace it)")
            for suffix in ("", "-wal", "-shm", "-journal"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(f"{self.path}{suffix}")
        self._t0 = time.monotonic()
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute(f"PRAGMA application_id = {schema.APPLICATION_ID}")
        conn.execute(f"PRAGMA user_version = {schema.SCHEMA_VERSION}")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        db = sqlite_utils.Database(conn)
        conn.execute("BEGIN")
        schema.create_tables(db, schema.step_record_columns())
        conn.execute(*_insert("session", self._session_row()))
        conn.execute("COMMIT")
        self._conn = conn
        self._step_cols = ["step", *[c for c in schema.step_record_columns() if c != "step"]]
        self._started = True
        self._pending_requests = self._new_requests()  # queued before the recording started
        self._thread = threading.Thread(target=self._writer, name="kvscope-recorder",
                                        daemon=True)
        self._thread.start()
        self._hook()
        return self

    def close(self) -> RecorderStatus:
        """Stop recording, write everything captured, finalise the file. Call it from the thread
        that drives the engine (or while the engine is idle). Idempotent."""
        if not self._started or self._closed:
            return self.status()
        self._closed = True
        self._unhook()
        leftover = self._pending_requests + self._new_requests()  # added after the last step
        self._wake.set()
        self._thread.join()
        if self._error is None:
            try:
                self._finalise(leftover)
            except Exception as e:  # noqa: BLE001 - report, never raise into the caller's loop
                self._fail(e)
        with contextlib.suppress(Exception):
            self._conn.close()
        return self.status()

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
        self.engine.add_step_listener(self._on_update)

    def _on_update(self, update) -> None:
        """A step listener: called on the engine thread at the end of each step (failed steps
        included: the engine publishes them too)."""
        if not self._closed:
            self._after_step([update])

    def _unhook(self) -> None:
        self.engine.remove_step_listener(self._on_update)

    # --------------------------------------------------- engine thread: capture
    def _after_step(self, updates: list) -> None:
        if self._error is not None or not updates:
            return
        try:
            self._capture(updates)
        except Exception as e:  # noqa: BLE001 - the engine must never fail because of us
            self._fail(e)

    def _capture(self, updates: list) -> None:
        engine = self.engine
        mgr = engine.manager
        new, self._pending_requests = self._pending_requests + self._new_requests(), []
        nct = {r: s.num_computed for r, s in mgr.seqs.items()}
        totals = (mgr.hit_tokens, mgr.query_tokens, mgr.num_requests_queried,
                  mgr.num_requests_hit, mgr.pool.num_evicted, mgr.num_cow_copies)
        # Turn events into plain tuples here, so the step's Event objects die now: held until
        # the writer's next batch they outlive two garbage-collector generations and trigger
        # full collections (measured with the tiny test model: ~0.1 s every few seconds).
        steps, finished, num_events = [], [], 0
        reqs = engine.requests
        for u in updates:
            tuples = schema.event_tuples(u.events)
            steps.append((u.record, tuples))
            num_events += len(tuples)
            for t in tuples:  # a terminal event: the request is finished by now
                if t[0] in _TERMINAL and t[2] not in self._reported:
                    finished.append(self._final_row(reqs[t[2]]))
        wall = updates[-1].record.wall_s
        self._step_s_ema = wall if not self._step_s_ema else 0.9 * self._step_s_ema + 0.1 * wall
        self._steps_since_kf += len(updates)
        self._events_since_kf += num_events
        raw = None
        if self._force_kf or len(updates) > 1 or self._keyframe_due():
            t = time.perf_counter()
            raw = _raw_pool(mgr)
            self._kf_copy_s = time.perf_counter() - t
            self._steps_since_kf = self._events_since_kf = 0
            self._force_kf = False
        why = [schema.explanation_row(u.record.step, e) for u in updates
               for e in u.explanations]
        self._queue.put(_Capture(steps, finished, nct, totals, new, raw, why))
        self._captured += len(updates)
        self._events_captured += num_events
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

    def _new_requests(self) -> list[_RequestInfo]:
        reqs = self.engine.requests
        buf = []
        while self._num_seen < len(reqs):
            r = reqs.get(self._next_rid)
            if r is None:  # ids are not consecutive: fall back to insertion order
                for r in itertools.islice(reqs.values(), self._num_seen, None):
                    buf.append(self._request_info(r))
                    self._next_rid = max(self._next_rid, r.request_id + 1)
                self._num_seen = len(reqs)
                break
            buf.append(self._request_info(r))
            self._num_seen += 1
            self._next_rid += 1
        return buf

    def _request_info(self, r) -> _RequestInfo:
        p = r.params
        params = dict(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k,
                      top_p=p.top_p, n=p.n, ignore_eos=p.ignore_eos, seed=p.seed,
                      num_stop=len(p.stop))
        return _RequestInfo(r.request_id, r.parent_id, r.sample_index, r.metrics.arrival_s,
                            len(r.prompt_token_ids), r.cache_salt, params,
                            list(r.prompt_token_ids) if self.record_text else None)

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
                except Exception as e:  # noqa: BLE001
                    self._fail(e)
                    with contextlib.suppress(Exception):
                        self._conn.execute("ROLLBACK")
            self._check_lag()
            if stopping:
                return

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
        for cap in batch:
            for info in cap.new_requests:
                req_rows.append(self._request_row(info))
            fin_rows += cap.finished
            last = len(cap.steps) - 1
            for i, (rec, events) in enumerate(cap.steps):
                n = len(events)
                if n:
                    event_rows.append(schema.pack_events(rec.step, events))
                    num_events += n
                row = [getattr(rec, c) for c in self._step_cols]
                if i == last:
                    row += list(cap.totals)
                    row.append(schema.encode_nct(cap.nct))
                else:
                    row += [None] * (len(TOTALS) + 1)
                row += [n, int(i == last)]
                step_rows.append(row)
            if cap.raw is not None:
                t = time.thread_time()
                kf_rows.append(schema.encode_keyframe(_snapshot_from_raw(cap.raw)))
                self._kf_build_s = time.thread_time() - t
        conn = self._conn
        conn.execute("BEGIN")
        # Multi-row statements: sqlite3 hands the GIL back to the engine around every call, so
        # a call per batch rather than per row keeps hand-offs (each a context switch for the
        # engine thread) to a handful per flush.
        if req_rows:
            _insert_rows(conn, "requests", list(req_rows[0]), req_rows)
        if fin_rows:  # every row has the same keys
            _insert_rows(conn, "requests", list(fin_rows[0]), fin_rows, upsert="request_id")
        if step_rows:
            cols = self._step_cols + list(TOTALS.values()) + ["nct", "num_events", "captured"]
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

    def _salt_digest(self, salt: str | None) -> str | None:
        if salt is None:
            return None
        return hmac.new(self._salt_key, salt.encode(), hashlib.sha256).hexdigest()[:16]

    def _request_row(self, info: _RequestInfo) -> dict:
        text = None
        if info.prompt_ids is not None:
            tok = getattr(self.engine, "tokenizer", None)
            if tok is not None:
                text = tok.decode(info.prompt_ids, skip_special_tokens=True)
        return dict(request_id=info.request_id, parent_id=info.parent_id,
                    sample_index=info.sample_index, arrival_s=info.arrival_s,
                    salt_digest=self._salt_digest(info.cache_salt),
                    prompt_tokens=info.prompt_tokens, params=json.dumps(info.params),
                    status="waiting" if info.parent_id is None else "running",
                    prompt_text=text)

    def _final_row(self, r) -> dict:
        """On the engine thread: the state of a request that has finished."""
        self._reported.add(r.request_id)
        return self._state_row(r)

    def _state_row(self, r) -> dict:
        row = _metrics_row(r.metrics)
        row.update(request_id=r.request_id, status=r.status.value, finish_reason=r.finish_reason,
                   error=r.error, cached_tokens=r.metrics.cached_tokens,
                   output_tokens=len(r.output_token_ids))
        if self.record_text:
            row["output_text"] = r.text
        return row

    # ------------------------------------------------------------- finalise
    def _finalise(self, leftover: list[_RequestInfo]) -> None:
        conn = self._conn
        conn.execute("BEGIN")
        if leftover:
            rows = [self._request_row(i) for i in leftover]
            _insert_rows(conn, "requests", list(rows[0]), rows)
        rows = [self._state_row(r) for r in self.engine.requests.values()
                if r.request_id not in self._reported]
        if rows:  # still running, or finished after the last step (e.g. cancelled)
            _insert_rows(conn, "requests", list(rows[0]), rows, upsert="request_id")
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
        mgr = engine.manager
        return dict(id=1, schema_version=schema.SCHEMA_VERSION, kvscope_version=_version(),
                    created_by="kvscope.sessions.Recorder",
                    model_name=getattr(loaded, "name", None),
                    model_fingerprint=getattr(loaded, "fingerprint", None),
                    engine_config=json.dumps(config, default=str),
                    block_size=mgr.block_size, num_blocks=mgr.pool.num_blocks,
                    machine=json.dumps(_machine()), device=_device(engine),
                    started_at=_now_iso(), started_unix=time.time(), monotonic_t0=self._t0,
                    record_text=int(self.record_text), keyframe_every=self.keyframe_every,
                    complete=0, num_steps=0, num_events=0)


def _raw_pool(mgr) -> SimpleNamespace:
    """Plain copies of the pool and the block tables: cheap on the engine thread (C-level list
    copies; ~1 ms for 16k blocks, against ~10 ms for KVCacheManager.snapshot)."""
    pool = mgr.pool
    return SimpleNamespace(
        step=mgr.step, block_size=mgr.block_size, ref_count=pool.ref_count[:],
        block_hash=pool.block_hash[:], last_use=pool.last_use[:],
        parent_hash=pool.parent_hash[:], hits=pool.hits[:],
        free_queue=list(pool.free_queue),
        tables={r: s.table[:] for r, s in mgr.seqs.items()},
        nct={r: s.num_computed for r, s in mgr.seqs.items()},
        totals=dict(hit_tokens=mgr.hit_tokens, query_tokens=mgr.query_tokens,
                    num_requests_queried=mgr.num_requests_queried,
                    num_requests_hit=mgr.num_requests_hit, num_evicted_blocks=pool.num_evicted,
                    num_cow_copies=mgr.num_cow_copies))


_NO_HASH = bytes(8)


def _snapshot_from_raw(raw: SimpleNamespace) -> Snapshot:
    """On the writer thread: the Snapshot the manager would have produced from this state."""
    return build_snapshot(raw.step, raw.block_size, np.array(raw.ref_count, dtype=np.int32),
                          _short_hashes(raw.block_hash),
                          np.array(raw.last_use, dtype=np.int64), raw.free_queue, raw.tables,
                          raw.nct, raw.totals, _short_hashes(raw.parent_hash),
                          np.array(raw.hits, dtype=np.int32))


def _short_hashes(hashes: list) -> np.ndarray:
    """short_hash of each (0 for None), vectorised."""
    short = b"".join([_NO_HASH if h is None else h[:8] for h in hashes])
    return np.frombuffer(short, dtype="<u8").astype(np.uint64)


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
