"""The Lab panel shows a real lab run (the head of the Mooncake trace): table, curves, verdict."""

from __future__ import annotations

from pathlib import Path

import pyqtgraph as pg

from kvscope.app.panels.lab_panel import LabPanel
from kvscope.lab import report
from kvscope.lab.traces import load_trace

HEAD = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_head200.jsonl"


def test_panel_shows_every_row_the_curve_and_the_ceilings(qtbot):
    trace = load_trace(HEAD, limit=60)
    rows, stream = report.run(trace, [1000, 4000], ["lru", "belady"], on_row=lambda r: None)
    curve = report.lru_curve(stream, [1000, 4000])
    panel = LabPanel()
    qtbot.addWidget(panel)
    panel.show_result(curve, rows)
    table = [[panel.table.item(i, j).text() for j in range(panel.table.columnCount())]
             for i in range(panel.table.rowCount())]
    assert [(t[0], t[1]) for t in table] == [("lru", "1,000"), ("lru", "4,000"),
                                             ("belady", "1,000"), ("belady", "4,000"),
                                             ("infinite", f"{rows[-1].pool_blocks:,}")]
    lru_4000 = next(r for r in rows if r.policy == "lru" and r.pool_blocks == 4000)
    assert table[1][3] == f"{lru_4000.token_hit_ratio:.2%}"
    lines = [i for i in panel.plot.getPlotItem().items if isinstance(i, pg.PlotDataItem)]
    assert len(lines[0].xData) == len(curve)  # the one-pass LRU curve
    assert any(isinstance(i, pg.InfiniteLine) for i in panel.plot.getPlotItem().items)
    assert f"{lru_4000.token_hit_ratio:.1%}" in panel.verdict.text()
