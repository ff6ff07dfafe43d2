"""The window's side of the engine process (`app/host/server.py` is the other side).

Each model load starts a fresh engine process; the old one keeps serving until the new model
has loaded, so a failed or cancelled load leaves the previous model running, and cancelling
really stops a load (the process is killed). A reader thread per process receives messages and
hands them to the GUI thread as queued signals. Frames are kept until the window takes one
(`take_frame`, at most ~30 times a second): two frames not yet taken merge into one, so every
step record and event reaches the window."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

from PySide6.QtCore import QObject, QTimer, Signal

from kvscope.app.frames import EngineInfo, Frame
from kvscope.app.host import protocol as p
from kvscope.app.host import zygote

CLOSE_TIMEOUT_S = 10.0  # a recording being finalised may take a moment
HEARTBEAT_MS = 500  # the loaded engine is pinged this often (one ping outstanding at most)
NOT_RESPONDING_S = 3.0  # no message for this long: "not responding"
SILENT_CLOSE_TIMEOUT_S = 0.5  # closing an engine that does not respond: kill it after this
NOT_RESPONDING = (f"Engine not responding: no answer for over {NOT_RESPONDING_S:g} s (stopped, "
                  "or stuck in a long step). Closing the window stops it.")


class _Process:
    """One engine process (forked by zygote.start), its socket and the thread that reads it."""

    def __init__(self, deliver, setup: str | None):
        self.proc, self.conn = zygote.start(setup)
        self.last_heard = time.monotonic()  # GUI thread: when its last message arrived
        self.pinged = False  # a ping is waiting for its answer
        self._send_lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, args=(deliver,), daemon=True,
                                       name="kvscope-engine-reader")
        self.reader.start()

    def _read(self, deliver) -> None:
        try:
            while True:
                try:
                    msg = self.conn.recv()
                except (EOFError, OSError):
                    try:
                        code = self.proc.wait(CLOSE_TIMEOUT_S)
                    except subprocess.TimeoutExpired:
                        code = None
                    deliver(self, p.Exited(_describe_exit(code)))
                    return
                except Exception as e:  # noqa: BLE001 - bytes that do not unpickle
                    msg = p.Unreadable(f"{type(e).__name__}: {e}")
                deliver(self, msg)
        except RuntimeError:  # "Signal source has been deleted": the window closed first
            return

    def send(self, msg: p.Command) -> bool:
        try:
            with self._send_lock:
                self.conn.send(msg)
            return True
        except (OSError, ValueError):  # the process is gone; its reader reports how
            return False

    def silent(self) -> bool:
        return time.monotonic() - self.last_heard > NOT_RESPONDING_S

    def close(self, wait: bool = False) -> None:
        """Ask the process to finish (it closes any recording first)."""
        self.send(p.Close())
        if wait:
            try:
                self.proc.wait(SILENT_CLOSE_TIMEOUT_S if self.silent() else CLOSE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "it did not exit"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class EngineClient(QObject):
    model_loaded = Signal(object)  # EngineInfo
    load_failed = Signal(str, str)  # message, detail
    engine_error = Signal(str, str)  # message, detail (the engine is paused, the app runs on)
    request_failed = Signal(str, str)  # message, detail (the engine serves the others on)
    engine_exited = Signal(str)  # the engine process died: what happened
    rejected = Signal(str)  # a request that could not be queued
    submitted = Signal(int)  # the id of a request the window submitted
    running_changed = Signal(bool)
    recording_changed = Signal(object, str)  # path or None, a one-line status
    idle = Signal()  # nothing left to do
    not_responding = Signal(bool)  # the loaded engine stopped answering / answers again
    _message = Signal(object, object)  # (process, message), from the reader threads

    def __init__(self, setup: str | None = None, parent=None):
        """setup: a Python file each engine process runs before it serves (server.main)."""
        super().__init__(parent)
        self.setup = setup
        self.info: EngineInfo | None = None  # the loaded engine
        self._current: _Process | None = None  # serves the loaded engine
        self._loading: _Process | None = None  # loading the next model
        self._closing: list[_Process] = []
        self._frame: Frame | None = None
        self.recording: str | None = None  # the file the engine records to
        self._message.connect(self._on_message)  # queued: emitted from reader threads
        self._silent = False
        self._heartbeat = QTimer(self, interval=HEARTBEAT_MS, timeout=self._beat)
        self._heartbeat.start()

    # ------------------------------------------------------------- commands
    def load(self, model: str, config) -> None:
        self.cancel_load()
        try:
            self._loading = _Process(self._message.emit, self.setup)
        except OSError as e:  # no process could be started (out of memory, no executable)
            self.load_failed.emit(f"cannot start the engine process: {e}", "")
            return
        self._loading.send(p.Load(model, config))

    def cancel_load(self) -> None:
        if self._loading is not None:
            loading, self._loading = self._loading, None
            loading.kill()

    def submit(self, prompt, params, cache_salt, run: bool = False) -> None:
        """Queue a prompt (run: and run the engine, in the same command)."""
        self._send(p.Submit(prompt, params, cache_salt, bool(run)))

    def run_workload(self, workload) -> None:
        self._send(p.RunWorkload(workload))

    def resume(self) -> None:
        self._send(p.Resume())

    def pause(self) -> None:
        self._send(p.Pause())

    def pace(self, steps_per_second: float) -> None:
        """Running steps at most this often (0: as fast as the engine can)."""
        self._send(p.Pace(steps_per_second))

    def step_once(self) -> None:
        self._send(p.Step())

    def cancel(self, request_id: int) -> None:
        self._send(p.Cancel(int(request_id)))

    def reset_prefix_cache(self) -> None:
        self._send(p.ResetPrefixCache())

    def watch(self, request_id: int | None) -> None:
        """Frames carry this request's text (prompt and output, cut at token boundaries)."""
        self._send(p.Watch(None if request_id is None else int(request_id)))

    def start_recording(self, path: str, record_text: bool) -> None:
        self._send(p.Record(path, bool(record_text)))

    def stop_recording(self) -> None:
        self._send(p.StopRecord())

    def shutdown(self) -> None:
        """Stop every engine process, letting each finish its recording."""
        self.cancel_load()
        procs = [proc for proc in (self._current, *self._closing) if proc is not None]
        self._current, self._closing, self.info = None, [], None
        for proc in procs:
            proc.close(wait=True)

    @property
    def pid(self) -> int | None:
        """The loaded engine's process id."""
        return self._current.proc.pid if self._current is not None else None

    @property
    def loading(self) -> bool:
        return self._loading is not None

    def _send(self, cmd: p.Command) -> None:
        if self._current is not None:
            self._current.send(cmd)

    def take_frame(self) -> Frame | None:
        """What happened since the last call (None if nothing); the engine then builds the
        next frame."""
        frame, self._frame = self._frame, None
        if frame is not None:
            self._send(p.Ready())
        return frame

    # ------------------------------------------------------------- messages
    def _beat(self) -> None:
        """Ping the loaded engine (it answers between steps) and say when it stops answering."""
        proc = self._current
        if proc is not None and not proc.pinged:
            proc.pinged = proc.send(p.Ping())
        self._set_silent(proc is not None and proc.silent())

    def _set_silent(self, silent: bool) -> None:
        if silent != self._silent:
            self._silent = silent
            self.not_responding.emit(silent)

    def _on_message(self, proc: _Process, msg) -> None:
        """One message from a process, dispatched by its type and by which process sent it
        (the loaded engine's, the one loading, or one closing); an unknown or malformed one is
        shown as an engine error."""
        proc.last_heard = time.monotonic()
        try:
            p.check(msg, p.MESSAGES, "message from the engine process")
        except p.ProtocolError as e:
            self.engine_error.emit(str(e), "")
            return
        if isinstance(msg, p.Unreadable):
            self.engine_error.emit(f"an unreadable message from the engine process ({msg.why})",
                                   "")
            return
        if isinstance(msg, p.Pong):
            proc.pinged = False
            if proc is self._current:
                self._set_silent(False)
            return
        if proc is self._loading:
            table = self._LOADING
        elif proc is self._current:
            table = self._CURRENT
        else:
            table = self._CLOSING
        handler = table.get(type(msg))
        if handler is not None:  # others mean nothing from this process now
            handler(self, proc, msg)

    # ----------------------------------------- the process loading a model
    def _on_loaded(self, loading: _Process, msg: p.Loaded) -> None:
        old, self._current, self._loading = self._current, loading, None
        if old is not None:
            old.close()
            self._closing.append(old)
        self.info, self._frame = msg.info, None
        self.model_loaded.emit(self.info)

    def _on_load_failed(self, loading: _Process, msg: p.LoadFailed | p.Exited) -> None:
        self._loading = None
        loading.close()
        if isinstance(msg, p.Exited):
            self.load_failed.emit(f"the engine process exited while loading ({msg.how})", "")
        else:
            self.load_failed.emit(msg.message, msg.detail)

    _LOADING = {p.Loaded: _on_loaded, p.LoadFailed: _on_load_failed, p.Exited: _on_load_failed}

    # ------------------------------------------------ the loaded engine's
    def _on_frame(self, _proc, msg: p.NewFrame) -> None:
        frame = msg.frame
        self.info.update(frame)
        self._frame = frame if self._frame is None else self._frame.merge(frame)

    def _on_recording(self, _proc, msg: p.Recording) -> None:
        self.recording = msg.path
        self.recording_changed.emit(msg.path, msg.note)

    def _on_exited(self, _proc, msg: p.Exited) -> None:
        self._current, self.info, self._frame = None, None, None
        self.running_changed.emit(False)
        if self.recording is not None:
            path, self.recording = self.recording, None
            self.recording_changed.emit(None, f"recording to {path} ended with the engine")
        self.engine_exited.emit(f"The engine process stopped unexpectedly ({msg.how}). "
                                "Load a model to start a new one.")

    _CURRENT = {
        p.NewFrame: _on_frame,
        p.Running: lambda self, _proc, msg: self.running_changed.emit(msg.running),
        p.Recording: _on_recording,
        p.Error: lambda self, _proc, msg: self.engine_error.emit(msg.message, msg.detail),
        p.RequestFailed: lambda self, _proc, msg: self.request_failed.emit(msg.message,
                                                                           msg.detail),
        p.Rejected: lambda self, _proc, msg: self.rejected.emit(msg.message),
        p.Submitted: lambda self, _proc, msg: self.submitted.emit(msg.request_id),
        p.Idle: lambda self, _proc, _msg: self.idle.emit(),
        p.Exited: _on_exited,
    }

    # ------------------------------------------- a process being closed
    def _on_closing_recording(self, _proc, msg: p.Recording) -> None:
        """An old engine finished its recording while closing."""
        self.recording = None
        self.recording_changed.emit(msg.path, msg.note)

    def _on_closed(self, proc: _Process, _msg) -> None:
        if proc in self._closing:
            self._closing.remove(proc)

    _CLOSING = {p.Recording: _on_closing_recording, p.Exited: _on_closed}
