"""A lab run in a worker process, so the window stays responsive and Cancel stops it at once
(the process is terminated). Qt-free: the Lab panel polls `LabRun.poll()` on a timer."""

from __future__ import annotations

import multiprocessing
import queue
from dataclasses import dataclass

from kvscope.lab.billing import TTL_GRID_S, Bill, Prices
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
    ttl_s: float = 0.0  # > 0: bill the trace under the ttl policy instead (lab.billing)
    prices: Prices | None = None

    @property
    def num_rows(self) -> int:
        if self.ttl_s:  # the bill, then the cost at each TTL of the curve
            return 1 + len(TTL_GRID_S)
        what_if = sum(p != "belady" for p in self.policies)  # each followed by its host rows
        return len(self.pool_sizes) * (len(self.policies) + what_if * len(self.host_sizes)) \
            + 1  # and the infinite cache


def _work(job: LabJob, out) -> None:
    from kvscope.lab import report
    from kvscope.sessions.lab_input import load_lab_input

    try:
        trace = load_lab_input(job.path, None, job.limit)
        trace.check_block_size(job.block_size)
        if job.ttl_s:
            _bill(job, trace, out)
            return
        _, stream = report.run(trace, list(job.pool_sizes), list(job.policies), job.block_size,
                               job.mode, on_row=lambda row: out.put(("row", row)),
                               host_sizes=job.host_sizes)
        out.put(("curve", report.lru_curve(stream, list(job.pool_sizes), trace=trace,
                                           groups=trace.groups)))
    except (ValueError, OSError) as e:  # a TraceError, or belady with windows only
        out.put(("error", str(e)))


def _bill(job: LabJob, trace, out) -> None:
    from kvscope.lab import billing

    kw = dict(block_size=job.block_size, mode=job.mode,
              hashes=billing.whatif.block_hashes(trace, job.block_size))
    out.put(("bill", billing.run(trace, job.ttl_s, job.prices, **kw)))
    points = []
    for ttl in TTL_GRID_S:
        points.append((ttl, billing.run(trace, ttl, job.prices, **kw).cost))
        out.put(("cost", points[-1]))
    out.put(("curve", points))


class LabRun:
    def __init__(self, job: LabJob):
        self.job = job
        self.rows: list[Row] = []
        self.curve: list[tuple[int, float]] | None = None  # billing: (TTL, cost) points
        self.bill: Bill | None = None
        self.costs: list[tuple[float, float]] = []  # billing: the curve's points so far
        self.error: str | None = None
        ctx = multiprocessing.get_context("spawn")  # no fork of a Qt process
        self._out = ctx.Queue()
        self._process = ctx.Process(target=_work, args=(job, self._out), daemon=True)
        self._process.start()

    @property
    def num_done(self) -> int:
        """Rows (or the bill and the curve's points) received so far."""
        return len(self.rows) + (self.bill is not None) + len(self.costs)

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
            elif kind == "bill":
                self.bill = value
            elif kind == "cost":
                self.costs.append(value)
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
