"""A lab run in a worker process, so the window stays responsive and Cancel stops it at once
(the process is terminated). Qt-free: the Lab panel polls `LabRun.poll()` on a timer."""

from __future__ import annotations

import multiprocessing
import queue
from dataclasses import dataclass

from kvscope.lab.report import Row


@dataclass(frozen=True)
class LabJob:
    path: str
    pool_sizes: tuple[int, ...]
    policies: tuple[str, ...]
    block_size: int = 16
    mode: str = "sequential"
    limit: int | None = None  # first N requests only
    host_sizes: tuple[int, ...] = ()  # host tiers behind each what-if row (lab.tiers)

    @property
    def num_rows(self) -> int:
        what_if = sum(p != "belady" for p in self.policies)  # each followed by its host rows
        return len(self.pool_sizes) * (len(self.policies) + what_if * len(self.host_sizes)) \
            + 1  # and the infinite cache


def _work(job: LabJob, out) -> None:
    from kvscope.lab import report
    from kvscope.sessions.lab_input import load_lab_input

    try:
        trace = load_lab_input(job.path, None, job.limit)
        trace.check_block_size(job.block_size)
        _, stream = report.run(trace, list(job.pool_sizes), list(job.policies), job.block_size,
                               job.mode, on_row=lambda row: out.put(("row", row)),
                               host_sizes=job.host_sizes)
        out.put(("curve", report.lru_curve(stream, list(job.pool_sizes), trace=trace,
                                           groups=trace.groups)))
    except (ValueError, OSError) as e:  # a TraceError, or belady with windows only
        out.put(("error", str(e)))


class LabRun:
    def __init__(self, job: LabJob):
        self.job = job
        self.rows: list[Row] = []
        self.curve: list[tuple[int, float]] | None = None
        self.error: str | None = None
        ctx = multiprocessing.get_context("spawn")  # no fork of a Qt process
        self._out = ctx.Queue()
        self._process = ctx.Process(target=_work, args=(job, self._out), daemon=True)
        self._process.start()

    @property
    def done(self) -> bool:
        return self.curve is not None or self.error is not None

    def poll(self) -> bool:
        """Take what the worker sent; True when something new arrived."""
        new = False
        while not self.done:
            try:
                # a worker that ended has sent all it will: wait for the pipe to deliver it
                kind, value = self._out.get(not self._process.is_alive(), 1)
            except queue.Empty:
                break
            new = True
            if kind == "row":
                self.rows.append(value)
            elif kind == "curve":
                self.curve = value
            else:
                self.error = value
        if not new and not self.done and not self._process.is_alive():
            self.error = f"the lab worker stopped (exit code {self._process.exitcode})"
            new = True
        return new

    def cancel(self) -> None:
        if self._process.is_alive():
            self._process.terminate()
        self._process.join(5)
        self._out.close()
