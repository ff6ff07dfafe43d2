"""The Lab panel: pick a trace, pool sizes, host tier sizes (none: one tier), policies and mode,
run the lab in a worker process (progress, Cancel), then the miss-ratio curves, the table of its
rows (with host tiers, each what-if row again per host size, its hits split by tier) and a
verdict (how far LRU is from the ceilings at the largest size replayed; what each host tier
adds there: lab.tiers.sizing_line). "Open the replay" asks the window to show the what-if run of
the selected row (or the first size, behind the first host size) as a frame source. With a TTL
the run is the prompt-cache bill instead (app.panels.lab_billing)."""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFileDialog,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from kvscope.app.panels import FrameIndependent
from kvscope.app.panels.lab_billing import BillingControls, BillView
from kvscope.app.panels.result_view import plot_over_table, result_table
from kvscope.app.plots.lab import draw_curves
from kvscope.app.workers.lab import LabJob, LabRun
from kvscope.engine import policies
from kvscope.lab import tiers
from kvscope.lab.report import Row, lab_policies
from kvscope.lab.whatif import MODES

POLL_MS = 100

COLUMNS = ("policy", "pool blocks", "mode", "token hit", "request hit", "evicted")
TIER_COLUMNS = ("host blocks", "device hit", "host hit")  # shown when a row has a host tier


class LabPanel(QWidget, FrameIndependent):
    # trace path, pool blocks, block size, policy, first N requests, host blocks, TTL s (0:
    # none): show the what-if replay
    open_requested = Signal(str, int, int, str, int, int, float)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.run: LabRun | None = None
        self.timer = QTimer(self)
        self.timer.timeout.connect(self._poll)
        self.plot = pg.PlotWidget(background="w")
        self.table = result_table(COLUMNS + TIER_COLUMNS)
        self.billing = BillingControls()
        self.bill_view = BillView()
        self.verdict = QLabel("Pick a trace (Mooncake or Qwen-Bailian JSONL) or a recorded "
                              "session and press Run.")
        self.verdict.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.addLayout(self._build_controls())
        self.setFocusProxy(self.path_edit)  # opened, the lab takes a trace first
        layout.addWidget(self.billing)
        layout.addWidget(self.verdict)
        split = plot_over_table(self.plot, self.table)
        split.addWidget(self.bill_view.table)
        layout.addWidget(split, 1)

    def _build_controls(self) -> QGridLayout:
        self.path_edit = QLineEdit()
        self.path_edit.setPlaceholderText("trace (.jsonl) or recorded session (.kvscope)")
        browse = QPushButton("Trace…")
        browse.clicked.connect(self._browse)
        self.sizes_edit = QLineEdit("2000 8000 30000")
        self.sizes_edit.setToolTip("Pool sizes in blocks, separated by spaces")
        self.host_edit = QLineEdit()
        self.host_edit.setPlaceholderText("none")
        self.host_edit.setToolTip("Host tier sizes in blocks behind the pool, separated by "
                                  "spaces (empty: none): each what-if row again with each, "
                                  "its hits split by tier (one full-attention group only)")
        self.block_size = QSpinBox(minimum=1, maximum=512, value=16)
        self.block_size.setToolTip("Tokens per block; must divide the trace's block")
        self.limit = QSpinBox(minimum=1, maximum=10**7, value=500)
        self.limit.setToolTip("Replay the first N requests of the trace")
        self.mode = QComboBox()
        self.mode.addItems(MODES)
        self.policy_boxes = {p: QCheckBox(p) for p in lab_policies()}
        for p in ("lru", "belady"):
            self.policy_boxes[p].setChecked(True)
        self.run_button = QPushButton("Run")
        self.run_button.clicked.connect(self.start)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setEnabled(False)
        self.cancel_button.clicked.connect(self.cancel)
        self.open_button = QPushButton("Open the replay at this pool size")
        self.open_button.setToolTip("Show the selected row's what-if run (LRU at the first size "
                                    "if none is selected) in the window, sequential mode")
        self.open_button.clicked.connect(self.open_replay)
        self.progress = QProgressBar()
        self.progress.setFormat("%v of %m rows")
        grid = QGridLayout()
        grid.addWidget(self.path_edit, 0, 0, 1, 3)
        grid.addWidget(browse, 0, 3)
        grid.addLayout(_labelled("pool blocks", self.sizes_edit), 1, 0, 1, 2)
        grid.addLayout(_labelled("host blocks", self.host_edit), 1, 2, 1, 2)
        grid.addLayout(_labelled("block size", self.block_size), 2, 0)
        grid.addLayout(_labelled("requests", self.limit), 2, 1, 1, 2)
        grid.addWidget(self.mode, 2, 3)
        policies = QHBoxLayout()
        for box in self.policy_boxes.values():
            policies.addWidget(box)
        grid.addLayout(policies, 3, 0, 1, 2)
        grid.addWidget(self.run_button, 3, 2)
        grid.addWidget(self.cancel_button, 3, 3)
        grid.addWidget(self.progress, 4, 0, 1, 2)
        grid.addWidget(self.open_button, 4, 2, 1, 2)
        return grid

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(
            self, "A request trace or a recorded session", "",
            "Traces and sessions (*.jsonl *.kvscope);;All files (*)")
        if path:
            self.path_edit.setText(path)

    def job(self) -> LabJob | str:
        """The run the controls describe, or why they describe none."""
        path = self.path_edit.text().strip()
        if not path:
            return "Pick a trace file first."
        sizes, hosts = _blocks(self.sizes_edit.text()), _blocks(self.host_edit.text())
        if sizes is None:
            return f"Pool sizes must be whole numbers of blocks: {self.sizes_edit.text()!r}"
        if not sizes or min(sizes) < 1:
            return "Give at least one pool size of at least 1 block."
        if hosts is None or (hosts and min(hosts) < 1):
            return f"Host sizes must be whole numbers of blocks: {self.host_edit.text()!r}"
        policies = tuple(p for p, box in self.policy_boxes.items() if box.isChecked())
        if not policies:
            return "Tick at least one policy."
        return LabJob(path, sizes, policies, self.block_size.value(), self.mode.currentText(),
                      self.limit.value(), tuple(dict.fromkeys(hosts)), self.billing.ttl_s(),
                      self.billing.prices())

    def start(self) -> None:
        job = self.job()
        if isinstance(job, str):
            self.verdict.setText(job)
            return
        self.cancel()
        self.run = LabRun(job)
        self.progress.setRange(0, job.num_rows)
        self.progress.setValue(0)
        self.run_button.setEnabled(False)
        self.cancel_button.setEnabled(True)
        self.verdict.setText(f"Replaying {job.path} …")
        self.timer.start(POLL_MS)

    def cancel(self) -> None:
        if self.run is None:
            return
        cancelled = not self.run.done
        self.run.cancel()
        self.run = None
        self._idle()
        if cancelled:
            self.verdict.setText("Cancelled.")

    def _idle(self) -> None:
        self.timer.stop()
        self.run_button.setEnabled(True)
        self.cancel_button.setEnabled(False)

    def _poll(self) -> None:
        run = self.run
        if run is None or not run.poll():
            return
        self.progress.setValue(run.num_done)
        if run.error is not None:
            self.verdict.setText(f"The lab run failed: {run.error}")
        elif run.curve is not None and run.bill is not None:
            self.show_bill(run.bill, run.curve)
        elif run.curve is not None:
            self.show_result(run.curve, run.rows)
        if run.done:
            run.cancel()  # the worker has ended: reap it
            self.run = None
            self._idle()

    def open_replay(self) -> None:
        job = self.job()
        if isinstance(job, str):
            self.verdict.setText(job)
            return
        policy, size, host = "lru", job.pool_sizes[0], (job.host_sizes or (0,))[0]
        row = self.table.currentRow()
        if 0 <= row < len(self.rows) and self.rows[row].policy in policies.POLICIES:
            r = self.rows[row]
            policy, size, host = r.policy, r.pool_blocks, r.host_blocks
        if self.bill is not None:  # the bill's run: its TTL, its pool
            policy, size, host = "ttl", self.bill.pool_blocks, 0
        self.open_requested.emit(job.path, size, job.block_size, policy, job.limit, host,
                                 self.bill.ttl_s if self.bill is not None else 0.0)

    rows: list[Row] = []
    bill = None  # the bill shown (lab.billing.Bill), if any

    def show_bill(self, bill, points: list[tuple[float, float]]) -> None:
        """A prompt-cache bill: cost against TTL, the prefixes, the bill in words."""
        self.rows, self.bill = [], bill
        self.table.hide()
        self.verdict.setText(self.bill_view.show(self.plot.getPlotItem(), bill, points))

    def show_result(self, lru_curve: list[tuple[int, float]], rows: list[Row]) -> None:
        self.table.show()
        self.bill_view.table.hide()
        self.rows, self.bill = list(rows), None
        draw_curves(self.plot.getPlotItem(), lru_curve, rows,
                    [r for r in rows if r.host_blocks and r.policy == "lru"])  # LRU + host
        self.table.setRowCount(len(rows))
        tiered = any(r.host_blocks for r in rows)
        for j in range(len(COLUMNS), len(COLUMNS) + len(TIER_COLUMNS)):
            self.table.setColumnHidden(j, not tiered)
        for i, r in enumerate(rows):
            values = (r.policy, f"{r.pool_blocks:,}", r.mode, f"{r.token_hit_ratio:.2%}",
                      f"{r.request_hit_ratio:.2%}", f"{r.evicted_blocks:,}",
                      f"{r.host_blocks:,}" if r.host_blocks else "-",
                      f"{r.device_hit_ratio:.2%}", f"{r.host_hit_ratio:.2%}")
            for j, text in enumerate(values):
                item = QTableWidgetItem(text)
                if j:
                    item.setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
                self.table.setItem(i, j, item)
        self.verdict.setText(verdict(rows))
        # (a line per host size: the layout would squeeze a wrapped label to one line)
        self.verdict.setMinimumHeight(self.verdict.heightForWidth(max(self.verdict.width(),
                                                                      200)))


def _blocks(text: str) -> list[int] | None:
    """Sizes in blocks separated by spaces ("2,000" too); None: not whole numbers."""
    try:
        return [int(t.replace(",", "").replace("_", "")) for t in text.split()]
    except ValueError:
        return None


def _labelled(label: str, widget) -> QHBoxLayout:
    row = QHBoxLayout()
    row.addWidget(QLabel(label))
    row.addWidget(widget, 1)
    return row


def verdict(rows: list[Row]) -> str:
    lru = max((r for r in rows if r.policy == "lru" and not r.host_blocks),
              key=lambda r: r.pool_blocks, default=None)
    inf = next((r for r in rows if r.policy == "infinite"), None)
    if lru is None or inf is None:
        return "No LRU replay in this run."
    best = next((r for r in rows if r.policy == "belady" and r.pool_blocks == lru.pool_blocks),
                None)
    text = f"LRU at {lru.pool_blocks:,} blocks: {lru.token_hit_ratio:.1%} of prompt tokens hit"
    if best is not None:
        text += f"; the best any policy could do at this size: {best.token_hit_ratio:.1%}"
    text += f"; with an unlimited pool: {inf.token_hit_ratio:.1%}."
    hosts = [r for r in rows if r.host_blocks and r.policy == "lru"
             and r.pool_blocks == lru.pool_blocks]
    lines = [tiers.sizing_line(r) for r in hosts]
    return "\n".join([text, *(f"{line[0].upper()}{line[1:]}." for line in lines)])
