"""The Lab panel (standalone for now): a lab run's miss-ratio curves, the table of its rows and
one verdict line (how far LRU is from the ceilings at the largest size replayed)."""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHeaderView,
    QLabel,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from kvscope.app.lab_plot import draw_curves
from kvscope.engine.lab.report import Row

COLUMNS = ("policy", "pool blocks", "mode", "token hit", "request hit", "evicted")


class LabPanel(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.plot = pg.PlotWidget(background="w")
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.table.verticalHeader().hide()
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)
        self.verdict = QLabel("Run `kvscope lab TRACE` to fill this panel.")
        self.verdict.setWordWrap(True)
        split = QSplitter(Qt.Vertical)
        split.addWidget(self.plot)
        split.addWidget(self.table)
        layout = QVBoxLayout(self)
        layout.addWidget(self.verdict)
        layout.addWidget(split)

    def show_result(self, lru_curve: list[tuple[int, float]], rows: list[Row]) -> None:
        draw_curves(self.plot.getPlotItem(), lru_curve, rows)
        self.table.setRowCount(len(rows))
        for i, r in enumerate(rows):
            values = (r.policy, f"{r.pool_blocks:,}", r.mode, f"{r.token_hit_ratio:.2%}",
                      f"{r.request_hit_ratio:.2%}", f"{r.evicted_blocks:,}")
            for j, text in enumerate(values):
                item = QTableWidgetItem(text)
                if j:
                    item.setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
                self.table.setItem(i, j, item)
        self.verdict.setText(verdict(rows))


def verdict(rows: list[Row]) -> str:
    lru = max((r for r in rows if r.policy == "lru"), key=lambda r: r.pool_blocks, default=None)
    inf = next((r for r in rows if r.policy == "infinite"), None)
    if lru is None or inf is None:
        return "No LRU replay in this run."
    best = next((r for r in rows if r.policy == "belady" and r.pool_blocks == lru.pool_blocks),
                None)
    text = f"LRU at {lru.pool_blocks:,} blocks: {lru.token_hit_ratio:.1%} of prompt tokens hit"
    if best is not None:
        text += f"; the best any policy could do at this size: {best.token_hit_ratio:.1%}"
    return text + f"; with an unlimited pool: {inf.token_hit_ratio:.1%}."
