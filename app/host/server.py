"""The engine's own process. Qt-free: it imports torch, the window's process does not.

The window talks to it over a socket wrapped in a `multiprocessing` Connection
(`app/host/client.py` is the other end). In its own process the engine never shares an
interpreter lock with drawing, so the window can take its time painting without slowing a step.

Commands in (tuples, the first item names them): load, submit, workload, resume, pause, step,
pace (steps per second while running, 0: as fast as it can), cancel, reset_prefix_cache, record,
stop_record, watch (the request whose text frames carry: the window's selection), ready (the
window took the last frame), ping, close. Messages out: loaded (EngineInfo), load_failed,
error (the engine paused on an exception), request_failed (one request's forward pass or
sampling raised; the others run on), rejected (a submit that could not be queued), submitted
(its request id), running, recording, idle, frame, pong.

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

import numpy as np

from kvscope.app.frames import EngineInfo, Frame, RequestRow, RequestText, evicted_at
from kvscope.engine.lifecycle import FINISHED, RUNNING, Lifecycle, Lifecycles
from kvscope.engine.stream import StepQueue
from kvscope.engine.token_text import TokenPieces

HISTORY_WAIT_S = 5.0  # saving the history waits at most this long for its last steps


class RequestTable:
    """The requests table, kept from the step stream alone (folded by engine.lifecycle): one
    row per request in arrival order, each in the state it is in after the step (prefill:
    prompt tokens still to compute; decode: it has sampled); finished rows beyond `history` are
    dropped, oldest first. Each request's prompt and output token ids are kept beside its row
    (never sent: the text view asks for one request's text)."""

    def __init__(self, history: int = 1024):
        self.rows: dict[int, RequestRow] = {}
        self.tokens: dict[int, tuple[list[int], list[int]]] = {}  # (prompt ids, output ids)
        self.history = history
        self.lifecycles = Lifecycles()
        self._finished: list[int] = []

    def apply(self, update) -> None:
        rows = self.rows
        for r in update.new_requests:
            if r.request_id in rows:  # already shown: submitted between steps
                continue
            life = self.lifecycles.arrive(r.request_id, r.parent_id)
            rows[r.request_id] = RequestRow.new(
                r.request_id, live_state(life), len(r.prompt_token_ids),
                cache_salt=r.cache_salt, parent_id=r.parent_id)
            self.tokens[r.request_id] = (r.prompt_token_ids, [])
        for e in update.events:
            if e.request_id in rows and (life := self.lifecycles.apply(e)) is not None:
                rows[e.request_id].state = live_state(life)
        for o in update.outputs:
            self.set_output(o)
        if len(self._finished) > self.history:
            drop, self._finished = (self._finished[:-self.history],
                                    self._finished[-self.history:])
            for rid in drop:
                rows.pop(rid, None)
                self.tokens.pop(rid, None)
                self.lifecycles.forget(rid)

    def set_output(self, o) -> None:
        """A request's state from its RequestOutput (after a step, or a submit or cancel
        between steps)."""
        life, finished_now = self.lifecycles.output(o)
        row = self.rows.get(o.request_id)
        if row is None:
            row = self.rows[o.request_id] = RequestRow.new(
                o.request_id, "waiting", len(o.prompt_token_ids or ()),
                cache_salt=o.cache_salt, parent_id=o.parent_id)
        prompt = self.tokens.get(o.request_id, (o.prompt_token_ids or [], []))[0]
        self.tokens[o.request_id] = (prompt, o.token_ids)  # a fresh list per output
        m = o.metrics
        row.cached_tokens, row.output_tokens, row.text = (o.num_cached_tokens, len(o.token_ids),
                                                          o.text)
        row.ttft_s, row.tpot_s = m.ttft_s, m.tpot_s
        row.state = live_state(life)
        if finished_now:
            self._finished.append(o.request_id)


def live_state(life: Lifecycle) -> str:
    """A live request's state as its row shows it: waiting, prefill (running, not sampled since
    it last computed a prompt chunk), decode, or "finished: <reason>"."""
    if life.status == FINISHED:
        return f"finished: {life.reason}"
    if life.status == RUNNING:
        return "decode" if life.sampled else "prefill"
    return "waiting"


def cpu_cores() -> int:
    """The CPUs this process may run on."""
    return (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1)


class SampledCounts:
    """(step, count) at each frame sent: at most about `limit` points, every other one dropped
    when there are more, so a long run keeps its whole span at a coarser grain."""

    def __init__(self, limit: int = 4096):
        self.steps: list[int] = []
        self.counts: list[int] = []
        self.limit = limit

    def add(self, step: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        if self.steps and self.steps[-1] == step:
            self.counts[-1] = count
        else:
            self.steps.append(step)
            self.counts.append(count)
        if len(self.steps) > self.limit:
            self.steps, self.counts = self.steps[::2], self.counts[::2]
        return np.array(self.steps), np.array(self.counts)


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
    re-imports the program's main module in the engine process."""
    ours, theirs = socket.socketpair()
    cmd = [sys.executable, "-c", "from kvscope.app.host.server import main; main()",
           str(theirs.fileno())] + ([os.fspath(setup)] if setup else [])
    with theirs:
        proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),))
    return proc, Connection(ours.detach())


def main(argv: list[str] | None = None) -> None:
    """`python -c "from kvscope.app.host.server import main; main()" FD [SETUP_FILE]`: serve
    the window on the socket FD. SETUP_FILE (optional) is run first: a plugin hook, used by the
    tests to inject faults into the real engine."""
    fd, *setup = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the window's to handle
    if setup:
        runpy.run_path(setup[0])
    EngineHost(Connection(int(fd))).serve()


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
                    if not self._handle_safely(self.conn.recv()):
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

    def _send(self, *msg) -> None:
        try:
            self.conn.send(msg)
        except (OSError, EOFError) as e:
            raise _WindowGone from e

    # --------------------------------------------------------------- commands
    def _handle_safely(self, msg: tuple) -> bool:
        """A command that fails pauses the engine and says why; the process serves on."""
        try:
            return self._handle(msg)
        except _WindowGone:
            raise
        except Exception as e:  # noqa: BLE001
            self.running = False
            self._send("running", False)
            self._send("error", _one_line(e), traceback.format_exc())
            return True

    def _handle(self, msg: tuple) -> bool:
        kind, *args = msg
        if kind == "ping":  # the window's heartbeat: answered between steps
            self._send("pong")
            return True
        if kind == "close":
            self._stop_recording()  # and say so: the window shows where the file is
            return False
        if kind == "ready":
            self.ready = True
            if self.dirty and self.engine is not None:
                self._publish()
        elif kind == "watch":
            self.watched, self._text_sent = args[0], None
            if self.engine is not None:
                self._publish(force=True)
        elif kind == "load":
            self._load(*args)
        elif self.engine is None:
            pass  # nothing else means anything before a model is loaded
        elif kind == "submit":
            self._submit(*args)
        elif kind == "workload":
            self._run_workload(*args)
        elif kind == "resume":
            self._set_running(True)
            self.due = 0.0
        elif kind == "pause":
            self._set_running(False)
        elif kind == "pace":
            self.step_s = 1.0 / args[0] if args[0] > 0 else 0.0
        elif kind == "step":
            self._set_running(False)
            if self._step() is None:
                self._send("idle")
            self._publish(force=True)
        elif kind == "cancel":
            if self.engine.cancel(*args):
                self.table.set_output(self.engine.request_output(*args))
                self._publish(force=True)
        elif kind == "reset_prefix_cache":
            self.engine.reset_prefix_cache()
            self._publish(force=True)
        elif kind == "record":
            self._start_recording(*args)
        elif kind == "stop_record":
            self._stop_recording()
        else:
            raise ValueError(f"unknown engine command {kind!r}")
        return True

    def _load(self, model: str, config) -> None:
        from kvscope.engine import Engine

        set_engine_threads()
        self._set_running(False)
        self._stop_recording()
        try:
            engine = Engine.from_pretrained(model, config)
        except Exception as e:  # noqa: BLE001 - every failure is shown, none crashes the app
            self._send("load_failed", _one_line(e), traceback.format_exc())
            return
        self.engine, self.runner = engine, None
        self.sub = StepQueue()
        engine.subscribe(self.sub)
        self.pending, self.table, self.dead_counts = Frame(), RequestTable(), SampledCounts()
        self.watched, self._pieces, self._text_sent = None, None, None
        loaded, runner = engine.loaded, engine.runner
        self._send("loaded", EngineInfo(
            model_name=loaded.name,
            model_config=loaded.hf_config,
            device=runner.device.type, cache_dtype=str(runner.cache_dtype).removeprefix("torch."),
            kv_bytes_per_token=runner.kv_bytes_per_token,
            num_blocks=engine.num_blocks, block_size=engine.config.block_size,
            history_path=self._start_history() if self.keep_history else None))
        self._publish(force=True)

    def _submit(self, prompt, params, cache_salt) -> None:
        from kvscope.engine.chat import chat_prompt_ids, is_messages

        try:
            if is_messages(prompt):  # the window has no tokenizer: templating happens here
                prompt = chat_prompt_ids(self.engine.tokenizer, prompt)
            rid = self.engine.add_request(prompt, params, cache_salt)
        except Exception as e:  # noqa: BLE001 - whatever it was, this request is not queued
            self._send("rejected", _one_line(e))
            return
        self.table.set_output(self.engine.request_output(rid))
        self._send("submitted", rid)
        self._publish(force=True)

    def _run_workload(self, workload) -> None:
        from kvscope.lab.workload_run import WorkloadRunner

        if self.runner is not None:
            self.runner.stop()
        try:
            self.runner = WorkloadRunner(self.engine, workload)
        except Exception as e:  # noqa: BLE001
            self._send("error", _one_line(e), traceback.format_exc())
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
            self._send("recording", path, "recording (since the model loaded, no text)")
            return
        try:
            self.recorder = Recorder(path, self.engine, record_text=record_text,
                                     overwrite=True).start()
        except (OSError, ValueError) as e:
            self._send("error", f"Cannot record to {path}: {e}", traceback.format_exc())
            return
        self._send("recording", path, "recording" + (" (with text)" if record_text else ""))

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
            self._send("recording", None, note)

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
            self._send("recording", None, note)

    def _set_running(self, running: bool) -> None:
        if running != self.running:
            self.running = running
            self._send("running", running)

    # ------------------------------------------------------------------- loop
    def _tick(self) -> None:
        started = time.monotonic()
        delay = self._step()
        if delay is None:
            self._publish(force=True)
            self._set_running(False)
            self._send("idle")
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
            self._send("error", _one_line(e), traceback.format_exc())
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
                self._send("request_failed", f"request #{rid} failed: {message}", detail)
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
        self._send("frame", f)
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


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
