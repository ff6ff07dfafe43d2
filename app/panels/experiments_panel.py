"""The Experiments panel: pick a textbook claim, measure it on the loaded model in a worker
process (app/workers/experiment.py; this process never imports torch), with a progress bar and
cancel; then the plot (PNG export), the table (CSV export) and the verdict line. Results saved in
a replayed session are shown with `show_results`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyqtgraph as pg
import pyqtgraph.exporters
from PySide6.QtCore import QProcess, Qt, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from kvscope.app.panels import FrameIndependent
from kvscope.app.panels.result_view import plot_over_table, result_table
from kvscope.app.plots.experiment import draw_result
from kvscope.lab.experiments import EXPERIMENTS, Result
from kvscope.lab.experiments.result import cell

PROMPTED = ("kv-formats",)  # the experiments measured on a prompt set (the Prompts box)
BUILTIN_PROMPTS = "Built-in passages"


class ExperimentsPanel(QWidget, FrameIndependent):
    finished = Signal(object)  # a Result, once a run completes

    def __init__(self, parent=None):
        super().__init__(parent)
        self.model = "demo"
        self.quick = False  # tiny sizes (tests)
        self.result: Result | None = None
        self.process: QProcess | None = None
        self.error = ""
        self.choice = QComboBox()
        self.choice.addItems(list(EXPERIMENTS))
        self.choice.currentTextChanged.connect(self._show_claim)
        self.setFocusProxy(self.choice)  # opened, the keys pick an experiment
        self.prompts = QComboBox()  # kv-formats: the built-in passages, or a file's prompts
        self.prompts.addItem(BUILTIN_PROMPTS, None)
        self.prompts.addItem("Workload or session file…", "")
        self.prompts.setToolTip("What kv-formats measures on: the built-in passages, a workload "
                                "(.jsonl) or a session recorded with its text (.kvscope)")
        self.prompts.activated.connect(self._prompts_picked)
        self.run_button = QPushButton("Run")
        self.run_button.clicked.connect(self.start)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.cancel)
        self.cancel_button.setEnabled(False)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.claim = QLabel()
        self.claim.setWordWrap(True)
        self.verdict = QLabel("Pick an experiment and press Run.")
        self.verdict.setWordWrap(True)
        self.verdict.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.plot = pg.PlotWidget(background="w")
        self.table = result_table()
        self.png_button = QPushButton("Export PNG…")
        self.png_button.clicked.connect(lambda: self._export("PNG image (*.png)", self.save_png))
        self.csv_button = QPushButton("Export CSV…")
        self.csv_button.clicked.connect(lambda: self._export("CSV (*.csv)", self.save_csv))
        top = QHBoxLayout()
        for w in (self.choice, self.prompts, self.run_button, self.cancel_button, self.progress):
            top.addWidget(w)
        exports = QHBoxLayout()
        exports.addStretch(1)
        exports.addWidget(self.png_button)
        exports.addWidget(self.csv_button)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(self.claim)
        layout.addWidget(plot_over_table(self.plot, self.table), 1)
        layout.addWidget(self.verdict)
        layout.addLayout(exports)
        self._show_claim(self.choice.currentText())
        self._set_exports()

    # ------------------------------------------------------------------ run
    def start(self) -> None:
        if self.process is not None:
            return
        name = self.choice.currentText()
        self.process = proc = QProcess(self)
        proc.setProcessChannelMode(QProcess.SeparateChannels)
        proc.readyReadStandardOutput.connect(self._read)
        proc.finished.connect(self._ended)
        args = ["-m", "kvscope.app.workers.experiment", name, "--model", self.model]
        if name in PROMPTED and self.prompts.currentData():
            args += ["--prompts", self.prompts.currentData()]
        proc.start(sys.executable, args + (["--quick"] if self.quick else []))
        self.error = ""
        self.progress.setValue(0)
        self.verdict.setText(f"Measuring {name} on {self.model}…")
        self._running(True)

    def cancel(self) -> None:
        if self.process is not None:
            self.error = "Cancelled."
            self.process.kill()

    def _read(self) -> None:
        while self.process is not None and self.process.canReadLine():
            line = bytes(self.process.readLine()).decode("utf-8", "replace").strip()
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if "progress" in message:
                self.progress.setValue(round(1000 * message["progress"]))
            elif "error" in message:
                self.error = message["error"]
            elif "result" in message:
                self.show_result(Result.from_dict(message["result"]))
                self.finished.emit(self.result)

    def _ended(self, *_args) -> None:
        self._read()
        proc, self.process = self.process, None
        if self.error or proc.exitCode() != 0 and self.result is None:
            err = bytes(proc.readAllStandardError()).decode("utf-8", "replace").strip()
            self.verdict.setText(self.error or (err.splitlines() or ["The worker failed."])[-1])
        proc.deleteLater()
        self._running(False)

    def _running(self, running: bool) -> None:
        self.run_button.setEnabled(not running)
        self.choice.setEnabled(not running)
        self.prompts.setEnabled(not running)
        self.cancel_button.setEnabled(running)
        if running:
            self.result = None
            self._set_exports()

    # ---------------------------------------------------------------- show
    def _show_claim(self, name: str) -> None:
        self.claim.setText(f"Claim: {EXPERIMENTS[name].claim}")
        self.prompts.setVisible(name in PROMPTED)

    def _prompts_picked(self, index: int) -> None:
        if self.prompts.itemData(index) == "":
            path, _ = QFileDialog.getOpenFileName(
                self, "Prompts", "", "Workloads and sessions (*.jsonl *.kvscope);;All files (*)")
            if path:
                self.use_prompts(Path(path))
            else:
                self.prompts.setCurrentIndex(0)

    def use_prompts(self, path: Path) -> None:
        """Measure kv-formats on this file's prompts (an entry of the Prompts box, picked)."""
        index = self.prompts.findData(str(path))
        if index < 0:
            index = self.prompts.count()
            self.prompts.addItem(path.name, str(path))
            self.prompts.setItemData(index, str(path), Qt.ToolTipRole)
        self.prompts.setCurrentIndex(index)

    def show_result(self, result: Result) -> None:
        self.result = result
        self._show_claim(result.name)
        draw_result(self.plot.getPlotItem(), result)
        self.table.clear()
        self.table.setColumnCount(len(result.columns))
        self.table.setHorizontalHeaderLabels(result.columns)
        self.table.setRowCount(len(result.rows))
        for i, row in enumerate(result.rows):
            for j, value in enumerate(row):
                item = QTableWidgetItem(cell(value))
                item.setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
                self.table.setItem(i, j, item)
        self.progress.setValue(1000)
        self.verdict.setText(f"Verdict ({result.model or 'model'}): {result.verdict}")
        self._set_exports()

    def show_results(self, results: list[Result]) -> None:
        """Results saved in a session: the latest is shown."""
        if results:
            self.show_result(results[-1])

    # -------------------------------------------------------------- export
    def _set_exports(self) -> None:
        for b in (self.png_button, self.csv_button):
            b.setEnabled(self.result is not None)

    def _export(self, kind: str, save) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Export", "", kind)
        if path:
            save(Path(path))

    def save_png(self, path: Path) -> None:
        exporter = pyqtgraph.exporters.ImageExporter(self.plot.getPlotItem())
        exporter.export(str(path))

    def save_csv(self, path: Path) -> None:
        path.write_text(self.result.to_csv(), encoding="utf-8")
