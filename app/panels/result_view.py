"""What the tools (Cache lab, Experiments) show under their controls: a plot over a table,
split so that both stay readable (the table's rows as compact as the requests')."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QSplitter, QTableWidget, QWidget


def result_table(columns: tuple[str, ...] = ()) -> QTableWidget:
    table = QTableWidget(0, len(columns))
    table.setHorizontalHeaderLabels(columns)
    table.setEditTriggers(QAbstractItemView.NoEditTriggers)
    table.verticalHeader().hide()
    table.verticalHeader().setDefaultSectionSize(table.fontMetrics().height() + 6)
    table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)
    return table


def plot_over_table(plot: QWidget, table: QTableWidget) -> QSplitter:
    """The plot gets three fifths of the height, the table the rest (both grow alike)."""
    split = QSplitter(Qt.Vertical)
    split.addWidget(plot)
    split.addWidget(table)
    split.setChildrenCollapsible(False)
    split.setSizes([300, 200])
    return split
