"""The engine's own process. Qt-free: it imports torch, the window's process does not.

The window talks to it over a socket wrapped in a `multiprocessing` Connection
(`app/engine_client.py` is the other end). In its own process the engine never shares an
interpreter lock with drawing, so the window can take its time painting without slowing a step.

Commands in (tuples, the first item names them): load, submit, workload, resume, pause, step,
cancel, reset_prefix_cache, record, stop_record, ready (the window took the last frame), close.
Messages out: loaded (EngineInfo), load_failed, error (the engine paused on an exception),
rejected (a submit that could not be queued), submitted (its request id), running, recording,
idle, frame.

Frames are paced by the window: after one is sent the next is built only once the window says
`ready`, so snapshots it would drop are never built, while every step record and event is kept
and sent with the next frame. A user action (submit, step, cancel, ...) sends a frame at once.
If the window's process dies the socket closes: the host finishes any recording and exits."""

from __future__ import annotations

import os
import runpy
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import numpy as np

from kvscope.engine import events as ev
from kvscope.engine.explain import MissExplanation
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
    explanations: dict[int, MissExplanation] = field(default_factory=dict)  # newly admitted

    def merge(self, later: Frame) -> Frame:
        """This frame followed by a later one, as if the window had taken only the later."""
        self.records.extend(later.records)
        self.events.extend(later.events)
        self.explanations.update(later.explanations)
        self.snapshot, self.requests, self.evicted = later.snapshot, later.requests, later.evicted
        return self


@dataclass
class EngineInfo:
    """What the window knows about the engine in the other process."""

    model_name: str
    model_config: dict  # the model's config.json
    device: str  # "cpu", "cuda", ...
    cache_dtype: str  # what the KV cache really stores, e.g. "bfloat16"
    kv_bytes_per_token: int  # measured from the cache tensor
    num_blocks: int
    block_size: int
    num_steps: int = 0  # steps run so far, as of the latest frame
    explanations: dict[int, MissExplanation] = field(default_factory=dict)

    def explain_miss(self, request_id: int) -> MissExplanation:
        """Why a request's prompt did not fully hit (KeyError: not admitted yet)."""
        return self.explanations[request_id]

    def update(self, frame: Frame) -> None:
        if frame.records:
            self.num_steps = frame.records[-1].step + 1
        self.explanations.update(frame.explanations)


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


def engine_threads() -> int:
    """CPU threads for the engine: all cores but one, which the window draws on."""
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count() or 1)
    return max(1, cores - 1)


def start(setup: str | os.PathLike | None = None) -> tuple[subprocess.Popen, Connection]:
    """Start an engine process; return it and the window's end of its socket. Started as
    `python -c` with one end of a socket pair: unlike multiprocessing's spawn, this never
    re-imports the program's main module in the engine process."""
    ours, theirs = socket.socketpair()
    cmd = [sys.executable, "-c", "from kvscope.app.engine_host import main; main()",
           str(theirs.fileno())] + ([os.fspath(setup)] if setup else [])
    with theirs:
        proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),))
    return proc, Connection(ours.detach())


def main(argv: list[str] | None = None) -> None:
    """`python -c "from kvscope.app.engine_host import main; main()" FD [SETUP_FILE]`: serve
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
    def __init__(self, conn):
        self.conn = conn
        self.engine = None
        self.runner = None  # a WorkloadRunner feeding the engine, if a workload is running
        self.recorder = None
        self.running = False
        self.due = 0.0  # monotonic time of the workload's next arrival
        self.ready = True  # the window has taken the last frame
        self.dirty = False  # something happened since the last frame
        self.pending = Frame()  # records and events not sent yet
        self.explained: dict[int, MissExplanation] = {}  # what the window has been sent

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
        if kind == "close":
            self._stop_recording()  # and say so: the window shows where the file is
            return False
        if kind == "ready":
            self.ready = True
            if self.dirty and self.engine is not None:
                self._publish()
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
        elif kind == "step":
            self._set_running(False)
            if self._step() is None:
                self._send("idle")
            self._publish(force=True)
        elif kind == "cancel":
            if self.engine.cancel(*args):
                self._publish(force=True)
        elif kind == "reset_prefix_cache":
            self.engine.manager.reset_prefix_cache()
            self._publish(force=True)
        elif kind == "record":
            self._start_recording(*args)
        elif kind == "stop_record":
            self._stop_recording()
        else:
            raise ValueError(f"unknown engine command {kind!r}")
        return True

    def _load(self, model: str, config) -> None:
        import torch

        from kvscope.engine import Engine

        if "OMP_NUM_THREADS" not in os.environ:  # the user's choice wins
            torch.set_num_threads(engine_threads())
        self._set_running(False)
        self._stop_recording()
        try:
            engine = Engine.from_pretrained(model, config)
        except Exception as e:  # noqa: BLE001 - every failure is shown, none crashes the app
            self._send("load_failed", _one_line(e), traceback.format_exc())
            return
        self.engine, self.runner = engine, None
        self.sub = engine.subscribe()
        self.pending, self.explained = Frame(), {}
        loaded, runner = engine.loaded, engine.runner
        self._send("loaded", EngineInfo(
            model_name=loaded.name,
            model_config=loaded.hf_config,
            device=runner.device.type, cache_dtype=str(runner.cache_dtype).removeprefix("torch."),
            kv_bytes_per_token=runner.kv_bytes_per_token,
            num_blocks=engine.num_blocks, block_size=engine.manager.block_size))
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
        self._send("submitted", rid)
        self._publish(force=True)

    def _run_workload(self, workload) -> None:
        from kvscope.engine.workload import WorkloadRunner

        if self.runner is not None:
            self.runner.stop()
        try:
            self.runner = WorkloadRunner(self.engine, workload)
        except Exception as e:  # noqa: BLE001
            self._send("error", _one_line(e), traceback.format_exc())
            return
        self._set_running(True)
        self.due = 0.0

    def _start_recording(self, path: str, record_text: bool) -> None:
        from kvscope.sessions import Recorder

        self._stop_recording()
        try:
            self.recorder = Recorder(path, self.engine, record_text=record_text,
                                     overwrite=True).start()
        except (OSError, ValueError) as e:
            self._send("error", f"Cannot record to {path}: {e}", traceback.format_exc())
            return
        self._send("recording", path, "recording" + (" (with text)" if record_text else ""))

    def _stop_recording(self, report: bool = True) -> None:
        if self.recorder is None:
            return
        recorder, self.recorder = self.recorder, None
        status = recorder.close()
        note = f"recorded {status.steps_written} steps to {recorder.path}"
        if status.error:
            note += f" (stopped early: {status.error})"
        if report:
            self._send("recording", None, note)

    def _set_running(self, running: bool) -> None:
        if running != self.running:
            self.running = running
            self._send("running", running)

    # ------------------------------------------------------------------- loop
    def _tick(self) -> None:
        delay = self._step()
        if delay is None:
            self._publish(force=True)
            self._set_running(False)
            self._send("idle")
        else:
            self.due = time.monotonic() + delay

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
        f.records.extend(u.record for u in updates)
        f.events.extend(e for u in updates for e in u.events)
        self.dirty = True
        if not (self.ready or force):
            return
        f.snapshot = snap = engine.snapshot()
        f.evicted = np.asarray([b for e in f.events if e.kind == ev.EVICTED
                                and e.step == snap.step for b in e.blocks], dtype=np.int64)
        f.requests = request_rows(engine)
        f.explanations = {rid: why for rid, why in engine.manager.explanations.items()
                          if self.explained.get(rid) is not why}  # new, or re-admitted
        self.explained.update(f.explanations)
        self._send("frame", f)
        self.pending, self.ready, self.dirty = Frame(), False, False


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
