"""The Experiments panel runs a real experiment in its worker process (the window process never
imports torch), shows table, plot and verdict, exports PNG and CSV, and cancels."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pyqtgraph as pg
from PySide6.QtGui import QImage

from kvscope.app.panels.experiments_panel import ExperimentsPanel

RUN_TIMEOUT_MS = 90_000


def panel_for(qtbot, name: str) -> ExperimentsPanel:
    panel = ExperimentsPanel()
    qtbot.addWidget(panel)
    panel.quick = True
    panel.choice.setCurrentText(name)
    return panel


def test_a_run_fills_table_plot_and_verdict_and_exports(qtbot, tmp_path):
    panel = panel_for(qtbot, "block-size")
    assert panel.claim.text().startswith("Claim: Block size trades")
    assert not panel.csv_button.isEnabled()
    with qtbot.waitSignal(panel.finished, timeout=RUN_TIMEOUT_MS) as done:
        panel.start()
        assert panel.cancel_button.isEnabled() and not panel.run_button.isEnabled()
    result = done.args[0]
    qtbot.waitUntil(lambda: panel.process is None, timeout=10_000)
    assert result.name == "block-size" and result.model == "demo"
    assert [panel.table.item(i, 0).text() for i in range(panel.table.rowCount())] == \
        ["8", "16", "32", "64"]
    assert panel.verdict.text() == f"Verdict (demo): {result.verdict}"
    lines = [i for i in panel.plot.getPlotItem().items if isinstance(i, pg.PlotDataItem)]
    assert [list(line.yData) for line in lines] == [
        [float(v) for v in result.column(c)] for c in result.ys]
    assert panel.progress.value() == 1000 and panel.csv_button.isEnabled()
    panel.save_csv(tmp_path / "r.csv")
    assert list(csv.reader((tmp_path / "r.csv").open()))[0] == result.columns
    panel.save_png(tmp_path / "r.png")
    assert not QImage(str(tmp_path / "r.png")).isNull()


def test_cancel_ends_the_worker_and_keeps_the_panel_usable(qtbot):
    panel = panel_for(qtbot, "naive-vs-cached")
    panel.quick = False  # long enough to be cancelled mid-run
    panel.start()
    panel.cancel()
    qtbot.waitUntil(lambda: panel.process is None, timeout=20_000)
    assert panel.verdict.text() == "Cancelled." and panel.result is None
    assert panel.run_button.isEnabled() and not panel.cancel_button.isEnabled()


def test_a_model_that_does_not_load_is_one_line_in_the_verdict(qtbot):
    panel = panel_for(qtbot, "fp8")
    panel.model = "/no/such/model"
    panel.start()
    qtbot.waitUntil(lambda: panel.process is None, timeout=30_000)
    assert panel.verdict.text() == "model folder not found: /no/such/model"
    assert panel.result is None and panel.run_button.isEnabled()


def test_saved_results_are_shown_without_running(qtbot):
    from kvscope.lab.experiments import warmup

    panel = panel_for(qtbot, "fp8")
    saved = warmup.summarize([[1, 2.0, 9.0], [2, 1.0, 4.0], [3, 1.0, 4.1]])
    panel.show_results([saved])
    assert panel.choice.currentText() == "fp8"  # the picker is left alone
    assert panel.claim.text() == f"Claim: {saved.claim}"
    assert panel.table.rowCount() == 3 and panel.verdict.text().endswith(saved.verdict)


PANEL_WITHOUT_TORCH = """
import sys
from PySide6.QtWidgets import QApplication
app = QApplication([])
from kvscope.app.panels.experiments_panel import ExperimentsPanel
p = ExperimentsPanel()
p.quick = True
p.choice.setCurrentText("fp8")
got = []
p.finished.connect(got.append)
p.start()
import time
deadline = time.monotonic() + 90
while p.process is not None and time.monotonic() < deadline:
    app.processEvents()
    time.sleep(0.01)
print(len(got), "torch" in sys.modules)
"""


def test_the_panel_process_never_imports_torch():
    out = subprocess.run([sys.executable, "-c", PANEL_WITHOUT_TORCH], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "False"]


def test_kv_formats_runs_on_the_prompts_file_picked(qtbot, tmp_path):
    from PySide6.QtCore import Qt

    panel = ExperimentsPanel()
    qtbot.addWidget(panel)
    panel.quick = True
    panel.show()
    assert not panel.prompts.isVisible()  # block-size, first in the list, has no prompt set
    panel.choice.setFocus()
    qtbot.keyClicks(panel.choice, "kv")
    assert panel.choice.currentText() == "kv-formats" and panel.prompts.isVisible()
    assert panel.prompts.currentText() == "Built-in passages"
    short = tmp_path / "short.jsonl"
    short.write_text('{"prompt_ids": [5]}\n')
    panel.use_prompts(short)
    assert panel.prompts.currentText() == "short.jsonl"
    qtbot.mouseClick(panel.run_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: panel.process is None, timeout=RUN_TIMEOUT_MS)
    assert panel.verdict.text() == f"{short}: no prompt of 2 tokens or more"
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "The river rose through the night and the fields"}\n')
    panel.use_prompts(good)
    with qtbot.waitSignal(panel.finished, timeout=RUN_TIMEOUT_MS) as done:
        qtbot.mouseClick(panel.run_button, Qt.LeftButton)
        assert not panel.prompts.isEnabled()
    result = done.args[0]
    assert result.name == "kv-formats"
    rows = [panel.table.item(i, 0).text() for i in range(panel.table.rowCount())]
    assert rows[:3] == ["float32", "bfloat16", "fp8"]
    assert panel.table.item(0, result.columns.index("KLD mean")).text() == "0"
    assert panel.verdict.text().startswith("Verdict (demo): bfloat16: KLD ")
