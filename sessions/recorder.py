"""Record an engine session to a SQLite file on a writer thread that the engine never waits on.

Usage (from whichever thread drives the engine: a script, the CLI, the engine process the
window starts, app/host/server.py)::

    rec = Recorder("run.kvscope", engine, record_text=False, keyframe_every=64)
    rec.start()            # creates the file and adds a step listener to the engine
    ...                    # engine.step() / engine.generate() / a WorkloadRunner, as usual
    rec.status()           # RecorderStatus: steps written, backlog, lagging, error (any thread)
    rec.close()            # unhooks, flushes, finalises (on the engine's thread, engine idle)

or ``with Recorder(path, engine) as rec: ...``. The engine is not thread-safe, so start() and
close() belong on the thread that steps it (in the window's engine process: its command loop,
between steps); status() may be polled from anywhere.

How the data gets out of the engine thread cheaply:

- ``start()`` subscribes to the engine's step stream (see kvscope.engine.stream). Right after
  each step, on the engine thread, `_on_update` takes the step's StepUpdate (records, events,
  new requests, finished outputs, computed-token counts, counters); events become plain tuples
  (so the Event objects die young: kept until the next batch they would trigger the garbage
  collector's full collections); every ``keyframe_every`` steps it takes ``engine.pool_state()``
  (plain list copies, ~0.5 ms for 16k blocks, against ~10 ms for ``engine.snapshot()``). One
  item goes on an unbounded queue: about 60 us per step in all. The recorder reads nothing of
  the engine but the stream and its public methods.
- The writer thread (writer.py, SessionWriter: Recorder's writing half) wakes every
  ``flush_interval_s`` (never per step: each wake-up would cost the engine a GIL hand-off),
  turns raw copies into keyframe Snapshots (computed exactly as ``KVCacheManager.snapshot``
  computes them), packs each step's events into one row, and writes
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

from kvscope.engine.lifecycle import Lifecycles
from kvscope.sessions import schema
from kvscope.sessions.lock import SessionLock
from kvscope.sessions.writer import SessionWriter, _Capture, _RequestInfo, now_iso

log = logging.getLogger("kvscope.sessions")


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


class Recorder(SessionWriter):
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
        self._kf_groups = 0  # KV groups in the last keyframe: a step naming another forces one
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
        if self._force_kf or self._keyframe_due() or self._new_group(u.events):
            t = time.perf_counter()
            raw = self.engine.pool_state()
            self._kf_groups = len(raw.groups)
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

    def keyframe_next(self) -> None:
        """The next step gets a keyframe (an attached server's tiers changed: slots.layout)."""
        self._force_kf = True

    def _new_group(self, events) -> bool:
        """A block event of a KV group the last keyframe did not have (an attached server's
        group seen for the first time): its replay starts from a keyframe that has it."""
        n = self._kf_groups
        return any(e.group >= n for e in events)

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
                            list(r.prompt_token_ids), r.cache_breakpoint)

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
                    kv_bytes_per_token=getattr(engine, "kv_bytes_per_token", None),
                    machine=json.dumps(_machine()), device=_device(engine),
                    started_at=now_iso(), started_unix=time.time(), monotonic_t0=self._t0,
                    record_text=int(self.record_text), keyframe_every=self.keyframe_every,
                    block_hashes="raw" if self.raw_hashes else "keyed",
                    complete=0, num_steps=0, num_events=0)


def _metrics_row(m) -> dict:
    return dict(arrival_s=m.arrival_s, first_scheduled_s=m.first_scheduled_s,
                first_token_s=m.first_token_s, finished_s=m.finished_s, queue_s=m.queue_s,
                ttft_s=m.ttft_s, tpot_s=m.tpot_s, e2e_s=m.e2e_s,
                num_preemptions=m.num_preemptions)


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
