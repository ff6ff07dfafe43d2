"""A what-if lab replay as a frame source: the window shows a trace replayed through the real
`KVCacheManager` at one pool size and policy like any session, read-only.

The run is `kvscope.lab.replay.WhatIfReplay` (sequential mode, one step per request: at step i
request i is admitted and shown running, and freed when step i+1 begins): one pass gives the
timeline; a past step comes from the replay's nearest checkpoint. This source only turns what
the replay gives into frames. `open_lab_source` runs the pass off the GUI thread, with a
progress dialog and Cancel; `LabSource(trace, ...)` runs it where it is called."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QObject, Qt, Slot
from PySide6.QtWidgets import QProgressDialog

from kvscope.app.frames import Frame, RequestRow, evicted_at
from kvscope.app.sources.base import MAX_EVENTS, FrameSource
from kvscope.app.workers.lab_replay import ReplayThread
from kvscope.engine.explain import MissExplanation
from kvscope.lab.replay import WhatIfReplay
from kvscope.lab.traces import Trace
from kvscope.sessions import SessionError

READ_ONLY = "A what-if lab replay cannot be changed: press Back to live to use the engine"


def lab_replay(trace: Trace, pool_blocks: int, block_size: int = 16,
               policy: str = "lru", host_blocks: int = 0,
               ttl_s: float | None = None) -> WhatIfReplay:
    """The run a LabSource shows, not yet run (a trace without requests: SessionError);
    `host_blocks`: a host tier (lru) behind the pool; `ttl_s`: the ttl policy's lifetime."""
    if not trace.requests:
        raise SessionError(f"{trace.name}: the trace has no requests")
    return WhatIfReplay(trace, pool_blocks, block_size, policy, keep_events=MAX_EVENTS,
                        host_blocks=host_blocks, ttl_s=ttl_s)


class LabSource(FrameSource):
    def __init__(self, trace: Trace, pool_blocks: int, block_size: int = 16,
                 policy: str = "lru", replay: WhatIfReplay | None = None):
        """`replay`: the run already made (lab_replay(...).run(), e.g. on a worker thread);
        without it the run is made here."""
        if replay is None:
            replay = lab_replay(trace, pool_blocks, block_size, policy)
            replay.run()
        self.replay = replay
        self.trace, self.pool_blocks, self.block_size, self.policy = (
            trace, pool_blocks, block_size, policy)
        self.name = f"lab: {Path(trace.name).name} at {pool_blocks:,} blocks, {policy}"
        if replay.host_blocks:
            self.name += f", host tier {replay.host_blocks:,} blocks"
        if replay.ttl_s:
            self.name += f", TTL {replay.ttl_s:,.0f} s"
        self.read_only = READ_ONLY
        self._first = Frame(records=list(replay.records), events=list(replay.events),
                            dead_counts=replay.dead_counts)

    def take_frame(self) -> Frame | None:
        first, self._first = self._first, None
        return first

    def step_range(self) -> tuple[int, int]:
        return 0, len(self.trace.requests) - 1

    def frame_at(self, step: int) -> Frame:
        try:
            state = self.replay.state_at(step)
        except IndexError as e:
            raise SessionError(str(e)) from None
        return Frame(snapshot=state.snapshot, evicted=evicted_at(state.events, step),
                     requests=self._rows(step), dead=state.dead)

    def _rows(self, step: int) -> list[RequestRow]:
        rows, cached = [], self.replay.cached
        for i in range(step + 1):
            r = self.trace.requests[i]
            state = "prefill" if i == step and i in cached else (
                "finished: length" if i in cached else "finished: rejected")
            rows.append(RequestRow.new(i, state, r.input_length, cached_tokens=cached.get(i, 0),
                                       host_cached_tokens=self.replay.host_cached.get(i, 0)))
        return rows

    def explain(self, request_id: int, step: int | None) -> MissExplanation | None:
        """As the manager judged it at admission (if admitted by `step`)."""
        return self.replay.explanation(request_id, step)

    def settings(self) -> dict:
        return {"model": f"lab: {Path(self.trace.name).name}", "num_blocks": self.pool_blocks,
                "block_size": self.block_size, "kv_cache_dtype": None,
                "enable_prefix_caching": True, "policy": self.policy,
                "host_blocks": self.replay.host_blocks, "ttl_s": self.replay.ttl_s,
                "kv_bytes_per_token": self.trace.kv_bytes_per_token}


class LabOpening(QObject):
    """A lab replay being opened off the GUI thread (the trace read, then the pass): a progress
    dialog with Cancel; `on_ready(source)` once it is done, `on_error(text)` if it failed (a bad
    trace too); neither when cancelled. `thread`: the worker (not running once it ended)."""

    def __init__(self, parent, make, title: str, on_ready, on_error):
        super().__init__()
        self._on_ready, self._on_error = on_ready, on_error
        self.cancelled = False
        self.thread = ReplayThread(make)
        self.dialog = QProgressDialog(title, "Cancel", 0, 0, parent)  # busy until it is sized
        self.dialog.setWindowTitle("Opening the lab replay")
        self.dialog.setWindowModality(Qt.WindowModal)
        self.dialog.setMinimumDuration(300)  # a short run opens without a flash of a dialog
        self.dialog.setAutoClose(False)
        self.dialog.setAutoReset(False)
        self.dialog.canceled.connect(self.cancel)
        self.thread.sized.connect(lambda steps: self.dialog.setMaximum(steps))  # queued
        self.thread.progressed.connect(self._progressed)  # queued: to this (GUI) thread
        self.thread.finished.connect(self._finished)
        _OPENING.add(self)  # kept until the thread ends, whoever drops it
        if parent is not None:  # a window closed while it opens: the pass stops too
            parent.destroyed.connect(self._stop)
        self.thread.start()

    @property
    def running(self) -> bool:
        return self.thread.isRunning()

    @Slot()
    def cancel(self) -> None:
        """Stop the pass (within a step): nothing is opened."""
        if self.cancelled:
            return
        self._stop()
        self.dialog.close()

    @Slot(int)
    def _progressed(self, done: int) -> None:
        if not self.cancelled:  # progress still queued would show the dialog again
            self.dialog.setValue(done)

    @Slot()
    def _stop(self) -> None:
        self.cancelled = True
        self.thread.cancel()

    def wait(self, ms: int = 10_000) -> bool:
        return self.thread.wait(ms)

    @Slot()
    def _finished(self) -> None:
        _OPENING.discard(self)
        if self.cancelled:
            return
        self.dialog.close()
        r = self.thread.replay
        if self.thread.error is not None:
            self._on_error(self.thread.error)
        else:
            self._on_ready(LabSource(r.trace, r.pool_blocks, r.block_size, r.policy, replay=r))


_OPENING: set[LabOpening] = set()


def open_lab_source(parent, path: str, limit: int | None, pool_blocks: int, block_size: int,
                    policy: str, on_ready, on_error, host_blocks: int = 0,
                    ttl_s: float | None = None) -> LabOpening:
    """Open a lab replay of a trace or session file without blocking the GUI: it is read and
    replayed on a worker thread under a progress dialog (Cancel stops it and opens nothing);
    `on_ready(LabSource)` when it is done, `on_error(text)` if it failed (a file that does not
    read as a trace, a trace without requests, a block size that does not divide the trace's)."""
    from kvscope.sessions.lab_input import load_lab_input

    def make() -> WhatIfReplay:
        return lab_replay(load_lab_input(path, None, limit), pool_blocks, block_size, policy,
                          host_blocks, ttl_s)

    host = f", host tier {host_blocks:,} blocks" if host_blocks else ""
    host += f", TTL {ttl_s:,.0f} s" if ttl_s else ""
    title = f"Replaying {Path(path).name} at {pool_blocks:,} blocks, {policy}{host}…"
    return LabOpening(parent, make, title, on_ready, on_error)
