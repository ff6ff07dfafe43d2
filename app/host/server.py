"""The engine's own process. Qt-free: it imports torch, the window's process does not.

The window talks to it over a socket wrapped in a `multiprocessing` Connection
(`app/host/client.py` is the other end). In its own process the engine never shares an
interpreter lock with drawing, so the window can take its time painting without slowing a step.

Commands in and messages out are the typed dataclasses of `app/host/protocol.py`, dispatched
by one table (`EngineHost._handlers`); a command that is unknown or malformed is answered by
an `Error` message, and the process serves on.

Frames are paced by the window: after one is sent the next is built only once the window says
`ready`, so snapshots it would drop are never built, while every step record and event is kept
and sent with the next frame. A user action (submit, step, cancel, ...) sends a frame at once.
If the window's process dies the socket closes: the host finishes any recording and exits."""

from __future__ import annotations

import os
import runpy
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

from kvscope.app.frames import EngineInfo, Frame, RequestText, evicted_at
from kvscope.app.host import protocol
from kvscope.app.host.tables import RequestTable, SampledCounts
from kvscope.engine.kv_format_spec import block_format
from kvscope.engine.stream import StepQueue
from kvscope.engine.token_text import TokenPieces

HISTORY_WAIT_S = 5.0  # saving the history waits at most this long for its last steps
# Commands that mean nothing before a model is loaded (ignored then).
NEEDS_ENGINE = frozenset({protocol.Submit, protocol.RunWorkload, protocol.Resume, protocol.Pause,
                          protocol.Pace, protocol.Step, protocol.Cancel,
                          protocol.ResetPrefixCache, protocol.Record, protocol.StopRecord})


def cpu_cores() -> int:
    """The CPUs this process may run on."""
    return (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1)


def engine_threads() -> int:
    """CPU threads for the engine: all cores but one, which the window draws on."""
    return max(1, cpu_cores() - 1)


def set_engine_threads(threads: int | None = None) -> None:
    """torch's CPU threads: `threads` if given, else OMP_NUM_THREADS if set (the user's
    choice wins), else engine_threads()."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(engine_threads())


def start(setup: str | os.PathLike | None = None) -> tuple[subprocess.Popen, Connection]:
    """Start an engine process; return it and the window's end of its socket. Started as
    `python -c` with one end of a socket pair: unlike multiprocessing's spawn, this never
    re-imports the program's main module in the engine process. (The window forks its engine
    processes from a zygote instead where it can: zygote.start.)"""
    ours, theirs = socket.socketpair()
    with theirs:
        proc = subprocess.Popen(command(theirs.fileno(), setup), pass_fds=(theirs.fileno(),))
    return proc, Connection(ours.detach())


def command(fd: int, setup: str | os.PathLike | None = None) -> list[str]:
    """The command line of an engine process serving the socket `fd`."""
    return [sys.executable, "-c", "from kvscope.app.host.server import main; main()",
            str(fd)] + ([os.fspath(setup)] if setup else [])


def main(argv: list[str] | None = None) -> None:
    """`python -c "from kvscope.app.host.server import main; main()" FD [SETUP_FILE]`: serve
    the window on the socket FD. SETUP_FILE (optional) is run first: a plugin hook, used by the
    tests to inject faults into the real engine."""
    fd, *setup = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the window's to handle
    if setup:
        runpy.run_path(setup[0])
    EngineHost(Connection(int(fd))).serve()
    # Served and cleaned up (recordings finished, the history removed): exit now. Python's own
    # finalisation (torch's modules, the collector) took 0.5-1.5 s more, which the window waits
    # for when it closes or loads another model.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _WindowGone(Exception):
    pass


class EngineHost:
    def __init__(self, conn, keep_history: bool = True):
        """keep_history: record the session to a temporary file (off only to measure its cost:
        benchmarks/live_history.py)."""
        self.conn = conn
        self.keep_history = keep_history
        self.engine = None
        self.runner = None  # a WorkloadRunner feeding the engine, if a workload is running
        self.recorder = None  # a recording with text, from when the user asked
        self.history = None  # the recording every engine keeps, without text (temporary)
        self._history_dir = None
        self.save_to: str | None = None  # where "Record" (without text) saves the history
        self.running = False
        self.due = 0.0  # monotonic time of the next step (a workload's arrival, or the pace)
        self.step_s = 0.0  # the least time from one running step to the next (0: no pacing)
        self.ready = True  # the window has taken the last frame
        self.dirty = False  # something happened since the last frame
        self.pending = Frame()  # records and events not sent yet
        self.table = RequestTable()
        self.dead_counts = SampledCounts()  # dead blocks at each frame sent, for the timeline
        self.watched: int | None = None  # the request whose text frames carry
        self._pieces: tuple[int, TokenPieces, TokenPieces] | None = None  # the watched one's
        self._text_sent: tuple[int, int] | None = None  # (request, output tokens) last sent

    def serve(self) -> None:
        try:
            while True:
                if self.conn.poll(self._timeout()):
                    if not self._handle_safely(self._receive()):
                        return
                elif self.running:
                    self._tick()
        except (_WindowGone, EOFError, OSError):
            pass  # the window's process is gone: nobody to report to
        finally:
            self._stop_recording(report=False)
            self._close_history()

    def _timeout(self) -> float | None:
        if not self.running:
            return None  # wait for a command
        return max(0.0, self.due - time.monotonic())

    def _send(self, msg: protocol.Message) -> None:
        try:
            self.conn.send(msg)
        except (OSError, EOFError) as e:
            raise _WindowGone from e

    def _receive(self) -> object:
        """The next command, or the ProtocolError that replaces one that does not unpickle."""
        try:
            return self.conn.recv()
        except (OSError, EOFError):
            raise
        except Exception as e:  # noqa: BLE001 - pickle raises many kinds
            return protocol.ProtocolError(f"malformed engine command: {_one_line(e)}")

    # --------------------------------------------------------------- commands
    def _handle_safely(self, msg) -> bool:
        """A command that fails pauses the engine and says why; the process serves on."""
        try:
            return self._handle(msg)
        except _WindowGone:
            raise
        except Exception as e:  # noqa: BLE001
            self.running = False
            self._send(protocol.Running(False))
            if isinstance(e, protocol.ProtocolError):  # its text says all there is
                self._send(protocol.Error(str(e), ""))
            else:
                self._send(protocol.Error(_one_line(e), traceback.format_exc()))
            return True

    def _handle(self, msg) -> bool:
        """Run one command; False: the window said Close."""
        if isinstance(msg, protocol.ProtocolError):
            raise msg
        cmd = protocol.check(msg, protocol.COMMANDS, "engine command")
        if self.engine is None and type(cmd) in NEEDS_ENGINE:
            return True  # nothing else means anything before a model is loaded
        return self._handlers[type(cmd)](self, cmd) is not False

    def _on_ping(self, _cmd) -> None:  # the window's heartbeat: answered between steps
        self._send(protocol.Pong())

    def _on_close(self, _cmd) -> bool:
        self._stop_recording()  # and say so: the window shows where the file is
        return False

    def _on_ready(self, _cmd) -> None:
        self.ready = True
        if self.dirty and self.engine is not None:
            self._publish()

    def _on_watch(self, cmd: protocol.Watch) -> None:
        self.watched, self._text_sent = cmd.request_id, None
        if self.engine is not None:
            self._publish(force=True)

    def _on_submit(self, cmd: protocol.Submit) -> None:
        self._submit(cmd.prompt, cmd.params, cmd.cache_salt)
        if cmd.run:
            self._on_resume(cmd)

    def _on_resume(self, _cmd) -> None:
        self._set_running(True)
        self.due = 0.0

    def _on_pace(self, cmd: protocol.Pace) -> None:
        self.step_s = 1.0 / cmd.steps_per_second if cmd.steps_per_second > 0 else 0.0

    def _on_step(self, _cmd) -> None:
        self._set_running(False)
        if self._step() is None:
            self._send(protocol.Idle())
        self._publish(force=True)

    def _on_cancel(self, cmd: protocol.Cancel) -> None:
        if self.engine.cancel(cmd.request_id):
            self.table.set_output(self.engine.request_output(cmd.request_id))
            self._publish(force=True)

    def _on_reset_prefix_cache(self, _cmd) -> None:
        self.engine.reset_prefix_cache()
        self._publish(force=True)

    _handlers = {
        protocol.Ping: _on_ping,
        protocol.Close: _on_close,
        protocol.Ready: _on_ready,
        protocol.Watch: _on_watch,
        protocol.Load: lambda self, cmd: self._load(cmd.model, cmd.config),
        protocol.Submit: _on_submit,
        protocol.RunWorkload: lambda self, cmd: self._run_workload(cmd.workload),
        protocol.Resume: _on_resume,
        protocol.Pause: lambda self, _cmd: self._set_running(False),
        protocol.Pace: _on_pace,
        protocol.Step: _on_step,
        protocol.Cancel: _on_cancel,
        protocol.ResetPrefixCache: _on_reset_prefix_cache,
        protocol.Record: lambda self, cmd: self._start_recording(cmd.path, cmd.record_text),
        protocol.StopRecord: lambda self, _cmd: self._stop_recording(),
    }

    def _load(self, model: str, config) -> None:
        from kvscope.engine import Engine
        from kvscope.engine.models.weights import ModelLoadError

        set_engine_threads()
        self._set_running(False)
        self._stop_recording()
        try:
            engine = Engine.from_pretrained(model, config)
        except Exception as e:  # noqa: BLE001 - every failure is shown, none crashes the app
            # The loader's own errors are written for the user: no class name in the banner.
            self._send(protocol.LoadFailed(_one_line(e, not isinstance(e, ModelLoadError)),
                                           traceback.format_exc()))
            return
        self.engine, self.runner = engine, None
        self.sub = StepQueue()
        engine.subscribe(self.sub)
        self.pending, self.table, self.dead_counts = Frame(), RequestTable(), SampledCounts()
        self.watched, self._pieces, self._text_sent = None, None, None
        loaded, runner = engine.loaded, engine.runner
        self._send(protocol.Loaded(EngineInfo(
            model_name=loaded.name,
            model_config=loaded.hf_config,
            device=runner.device.type, cache_dtype=str(runner.cache_dtype).removeprefix("torch."),
            kv_bytes_per_token=runner.kv_bytes_per_token,
            num_blocks=engine.num_blocks, block_size=engine.config.block_size,
            history_path=self._start_history() if self.keep_history else None,
            chat_template=bool(getattr(engine.tokenizer, "chat_template", None)),
            kv_format=block_format(runner.format.name, runner.cache_dtype))))
        self._publish(force=True)

    def _submit(self, prompt, params, cache_salt) -> None:
        from kvscope.engine.chat import chat_prompt_ids, is_messages

        try:
            if is_messages(prompt):  # the window has no tokenizer: templating happens here
                prompt = chat_prompt_ids(self.engine.tokenizer, prompt)
            rid = self.engine.add_request(prompt, params, cache_salt)
        except Exception as e:  # noqa: BLE001 - whatever it was, this request is not queued
            self._send(protocol.Rejected(_one_line(e, not isinstance(e, ValueError))))
            return
        self.table.set_output(self.engine.request_output(rid))
        self._send(protocol.Submitted(rid))
        self._publish(force=True)

    def _run_workload(self, workload) -> None:
        from kvscope.lab.workload_run import WorkloadRunner

        if self.runner is not None:
            self.runner.stop()
        try:
            self.runner = WorkloadRunner(self.engine, workload)
        except Exception as e:  # noqa: BLE001
            self._send(protocol.Error(_one_line(e), traceback.format_exc()))
            return
        self._set_running(True)
        self.due = 0.0

    def _start_history(self) -> str | None:
        """Record the session to a temporary file, without text, so that the window can show
        any past step. None if it cannot (the window then shows the newest step only)."""
        from kvscope.sessions import Recorder

        self._close_history()
        self._history_dir = tempfile.TemporaryDirectory(prefix="kvscope-history-")
        path = Path(self._history_dir.name) / "history.kvscope"
        try:
            self.history = Recorder(path, self.engine).start()
        except (OSError, ValueError):
            self._close_history()
            return None
        return str(path)

    def _close_history(self) -> None:
        if self.history is not None:
            self.history.close()
            self.history = None
        if self._history_dir is not None:
            self._history_dir.cleanup()
            self._history_dir = None

    def _start_recording(self, path: str, record_text: bool) -> None:
        from kvscope.sessions import Recorder

        self._stop_recording()
        if not record_text and self.history is not None:
            # The history holds everything since the model loaded: saved on stop.
            self.save_to = path
            self._send(protocol.Recording(path, "recording (since the model loaded, no text)"))
            return
        try:
            self.recorder = Recorder(path, self.engine, record_text=record_text,
                                     overwrite=True).start()
        except (OSError, ValueError) as e:
            self._send(protocol.Error(f"Cannot record to {path}: {e}", traceback.format_exc()))
            return
        self._send(protocol.Recording(path, "recording" + (" (with text)" if record_text else "")))

    def _stop_recording(self, report: bool = True) -> None:
        if self.save_to is not None:
            self._save_history(report)
        if self.recorder is None:
            return
        recorder, self.recorder = self.recorder, None
        status = recorder.close()
        note = f"recorded {status.steps_written} steps to {recorder.path}"
        if status.error:
            note += f" (stopped early: {status.error})"
        if report:
            self._send(protocol.Recording(None, note))

    def _save_history(self, report: bool) -> None:
        from kvscope.sessions.save import save_copy

        path, self.save_to = self.save_to, None
        deadline = time.monotonic() + HISTORY_WAIT_S
        while self.history.status().backlog_steps and time.monotonic() < deadline:
            time.sleep(0.01)  # the writer commits every flush interval
        try:
            note = f"recorded {save_copy(self.history.path, path)} steps to {path}"
        except (OSError, sqlite3.Error) as e:
            note = f"could not save the session to {path}: {e}"
        if report:
            self._send(protocol.Recording(None, note))

    def _set_running(self, running: bool) -> None:
        if running != self.running:
            self.running = running
            self._send(protocol.Running(running))

    # ------------------------------------------------------------------- loop
    def _tick(self) -> None:
        started = time.monotonic()
        delay = self._step()
        if delay is None:
            self._publish(force=True)
            self._set_running(False)
            self._send(protocol.Idle())
        else:  # paced: a watchable demo (commands are still answered while it waits)
            self.due = max(time.monotonic() + delay, started + self.step_s)

    def _step(self) -> float | None:
        """One step of work. Returns None when there is nothing left to do, 0 to go on at once,
        or the seconds until a workload's next arrival."""
        engine = self.engine
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
            self._set_running(False)
            self._send(protocol.Error(_one_line(e), traceback.format_exc()))
            self._publish(force=True)
            return None
        self._publish()
        return delay

    def _publish(self, force: bool = False) -> None:
        """Fold what happened into the pending frame; send it if the window is ready for one
        (or a user action is waiting to see its effect)."""
        engine, f = self.engine, self.pending
        updates = self.sub.drain()
        for u in updates:
            for rid, message, detail in u.failures:
                self._send(protocol.RequestFailed(f"request #{rid} failed: {message}", detail))
            self.table.apply(u)
            f.merge(Frame.of_update(u))
        self.dirty = True
        if not (self.ready or force):
            return
        f.snapshot = snap = engine.snapshot()
        f.evicted = evicted_at(f.events, snap.step)
        f.dead = engine.dead_blocks()
        f.dead_counts = self.dead_counts.add(snap.step, len(f.dead))
        f.requests = list(self.table.rows.values())  # pickled as they are now, by _send
        f.text = self._watched_text()
        self._send(protocol.NewFrame(f))
        self.pending, self.ready, self.dirty = Frame(), False, False

    def _watched_text(self) -> RequestText | None:
        """The watched request's text, if it changed since it was last sent. Its prompt is cut
        into token pieces once, its output as tokens arrive."""
        rid = self.watched
        tokens = None if rid is None else self.table.tokens.get(rid)
        if tokens is None:
            return None
        prompt_ids, output_ids = tokens
        if (rid, len(output_ids)) == self._text_sent:
            return None
        if (self._pieces is None or self._pieces[0] != rid
                or len(output_ids) < len(self._pieces[2].ids)):
            tok = self.engine.tokenizer
            self._pieces = (rid, TokenPieces(tok), TokenPieces(tok))
            self._pieces[1].extend(prompt_ids)
        _, prompt, output = self._pieces
        output.extend(output_ids[len(output.ids):])
        self._text_sent = (rid, len(output_ids))
        return RequestText(rid, self.engine.config.block_size, list(prompt.pieces),
                           list(output.pieces))


def _one_line(e: BaseException, named: bool = True) -> str:
    """The error's first line; named: after its class name (not for the errors whose message
    is written for the user)."""
    text = str(e).strip().splitlines()
    if not text:
        return type(e).__name__
    return f"{type(e).__name__}: {text[0]}" if named else text[0]
