"""The engine lives in a worker thread: a long-lived QObject driven by queued signals.

After each step the worker folds what happened into a pending Frame; the GUI takes it from a
QTimer at <= 30 Hz (`take_frame`), so the engine never waits on drawing and intermediate
snapshots are dropped while every step record and event is kept."""

from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass, field

import numpy as np
from PySide6.QtCore import QObject, QTimer, Signal, Slot

from kvscope.engine import events as ev
from kvscope.engine.metrics import StepRecord
from kvscope.engine.snapshot import Snapshot


@dataclass
class RequestRow:
    request_id: int
    state: str  # waiting | prefill | decode | finished: <reason>
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    cache_salt: str | None
    parent_id: int | None
    text: str


@dataclass
class Frame:
    snapshot: Snapshot | None = None
    evicted: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    records: list[StepRecord] = field(default_factory=list)
    events: list[ev.Event] = field(default_factory=list)
    requests: list[RequestRow] = field(default_factory=list)


def request_rows(engine) -> list[RequestRow]:
    running = {r.request_id for r in engine.scheduler.running}
    rows = []
    for r in engine.requests.values():
        if r.finished:
            state = f"finished: {r.finish_reason}"
        elif r.request_id in running:
            state = "prefill" if r.is_prefill else "decode"
        else:
            state = "waiting"
        m = r.metrics
        rows.append(RequestRow(r.request_id, state, len(r.prompt_token_ids), m.cached_tokens,
                               len(r.output_token_ids), m.ttft_s, m.tpot_s, r.cache_salt,
                               r.parent_id, r.text))
    return rows


class EngineWorker(QObject):
    model_loaded = Signal(object)  # the Engine
    load_failed = Signal(str, str)  # message, detail
    engine_error = Signal(str, str)  # message, detail (the engine is paused, the app runs on)
    running_changed = Signal(bool)
    recording_changed = Signal(object, str)  # path or None, a one-line status
    idle = Signal()  # nothing left to do

    def __init__(self):
        super().__init__()
        self.engine = None
        self.runner = None  # a WorkloadRunner feeding the engine, if a workload is running
        self.recorder = None
        self.running = False
        self._lock = threading.Lock()
        self._frame = Frame()
        self._timer: QTimer | None = None

    # ------------------------------------------------------------ control
    @Slot(str, object)
    def load(self, model: str, config) -> None:
        from kvscope.engine import Engine  # torch import stays off the GUI's start-up path

        self.pause()
        self.stop_recording()
        try:
            engine = Engine.from_pretrained(model, config)
        except Exception as e:  # noqa: BLE001 - every failure is shown, none crashes the app
            self.load_failed.emit(_one_line(e), traceback.format_exc())
            return
        self.engine, self.runner = engine, None
        self._sub = engine.subscribe()
        with self._lock:
            self._frame = Frame()
        self._publish(force=True)
        self.model_loaded.emit(engine)

    @Slot(object, object, object)
    def submit(self, prompt, params, cache_salt) -> None:
        if self.engine is None:
            return
        self.engine.add_request(prompt, params, cache_salt)
        self._publish(force=True)

    @Slot(str, bool)
    def start_recording(self, path: str, record_text: bool) -> None:
        """The recorder is created and closed here, on the thread that steps the engine."""
        from kvscope.sessions import Recorder

        if self.engine is None:
            return
        self.stop_recording()
        try:
            self.recorder = Recorder(path, self.engine, record_text=record_text,
                                     overwrite=True).start()
        except (OSError, ValueError) as e:
            self.engine_error.emit(f"Cannot record to {path}: {e}", traceback.format_exc())
            return
        self.recording_changed.emit(path, "recording" + (" (with text)" if record_text else ""))

    @Slot()
    def stop_recording(self) -> None:
        if self.recorder is None:
            return
        recorder, self.recorder = self.recorder, None
        status = recorder.close()
        note = f"recorded {status.steps_written} steps to {recorder.path}"
        if status.error:
            note += f" (stopped early: {status.error})"
        self.recording_changed.emit(None, note)

    @Slot(object)
    def run_workload(self, workload) -> None:
        from kvscope.engine.workload import WorkloadRunner

        if self.engine is None:
            return
        if self.runner is not None:
            self.runner.stop()
        try:
            self.runner = WorkloadRunner(self.engine, workload)
        except Exception as e:  # noqa: BLE001
            self.engine_error.emit(_one_line(e), traceback.format_exc())
            return
        self.resume()

    @Slot()
    def resume(self) -> None:
        self.running = True
        self.running_changed.emit(True)
        self._schedule()

    @Slot()
    def pause(self) -> None:
        if self.running:
            self.running = False
            self.running_changed.emit(False)

    @Slot()
    def step_once(self) -> None:
        self.pause()
        if self._step() is None:
            self.idle.emit()
        elif self.engine is not None:
            self._publish(force=True)

    @Slot(int)
    def cancel(self, request_id: int) -> None:
        if self.engine is not None and self.engine.cancel(request_id):
            self._publish(force=True)

    @Slot()
    def reset_prefix_cache(self) -> None:
        if self.engine is not None:
            self.engine.manager.reset_prefix_cache()
            self._publish(force=True)

    # ------------------------------------------------------------- loop
    def _schedule(self) -> None:
        if self._timer is None:  # created here, in the worker thread
            self._timer = QTimer()
            self._timer.setSingleShot(True)
            self._timer.timeout.connect(self._tick)
        if not self._timer.isActive():
            self._timer.start(0)

    def _tick(self) -> None:
        if not self.running or self.engine is None:
            return
        delay = self._step()
        if not self.running:
            return
        if delay is None:
            self._publish(force=True)
            self.pause()
            self.idle.emit()
        elif delay > 0:
            self._timer.start(int(delay * 1000) + 1)  # the next arrival of the workload
        else:
            self._schedule()

    def _step(self) -> float | None:
        """One step of work. Returns None when there is nothing left to do, 0 to go on at once,
        or the seconds until a workload's next arrival."""
        engine = self.engine
        if engine is None:
            return None
        try:
            if self.runner is not None:
                delay = self.runner.advance()  # submits what is due, steps the engine
                if delay is None:
                    self.runner = None
                    delay = 0.0 if engine.has_unfinished() else None
            elif engine.has_unfinished():
                engine.step()
                delay = 0.0
            else:
                return None
        except Exception as e:  # noqa: BLE001
            self.pause()
            self.engine_error.emit(_one_line(e), traceback.format_exc())
            return None
        self._publish()
        return delay

    def _publish(self, force: bool = False) -> None:
        """Fold the step's records and events into the pending frame. The snapshot and the
        request rows (the costly part) are taken only once the GUI has taken the previous
        frame, or when forced (the loop stops, a user action): frames the GUI would drop are
        never built."""
        engine = self.engine
        updates = self._sub.drain()
        events = [e for u in updates for e in u.events]
        with self._lock:
            f = self._frame
            f.records.extend(u.record for u in updates)
            f.events.extend(events)
            if f.snapshot is not None and not force:
                return  # the GUI has not taken the last state yet
        snap = engine.snapshot()
        evicted = [b for e in events if e.kind == ev.EVICTED and e.step == snap.step
                   for b in e.blocks]
        rows = request_rows(engine)
        with self._lock:
            f = self._frame
            f.snapshot, f.requests = snap, rows
            f.evicted = np.asarray(evicted, dtype=np.int64)

    def take_frame(self) -> Frame | None:
        """Called from the GUI thread: what happened since the last call (None if nothing)."""
        with self._lock:
            f = self._frame
            if f.snapshot is None:
                return None
            self._frame = Frame()
            return f


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
