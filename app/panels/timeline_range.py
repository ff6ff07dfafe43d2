"""A range of steps on the timeline: shift+drag selects it, a line above the plots gives its
numbers (steps, wall time, tokens, mean and p95 step time, hit rate, evictions) with an Export
button, and the plots' right-click menu offers its export, the wall-clock axis and Fit all."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QEvent, Qt
from PySide6.QtGui import QAction
from PySide6.QtWidgets import QHBoxLayout, QLabel, QMenu, QPushButton, QSizePolicy, QWidget

from kvscope.app.panels.timeline_parts import range_stats
from kvscope.engine import events as ev


class RangeSelection:
    """The range and the menu of a Timeline (a mixin: the Timeline has `glw`, `time_plot`,
    `data`, `x`, `markers`, `index_at`, `step_x`, `fit`, `act_wall_clock` and the signal
    `export_range_requested`)."""

    _right_from = None

    def _init_range(self) -> None:
        self.range_steps: tuple[int, int] | None = None  # the first and last step in it
        self.range_box = QWidget()
        self.range_label = QLabel()
        self.range_label.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        self.export_button = QPushButton("Export range…")
        self.export_button.setToolTip("Write the steps of this range to a file: a Chrome trace "
                                      "for ui.perfetto.dev (.json) or one row per step (.csv)")
        self.export_button.clicked.connect(self.export_range)
        row = QHBoxLayout(self.range_box)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.range_label, 1)
        row.addWidget(self.export_button)
        self.range_box.hide()
        self.region = pg.LinearRegionItem(movable=False, brush=pg.mkBrush(0, 0, 0, 30))
        self.region.hide()
        self._drag_from: float | None = None

    def _init_menu(self) -> None:
        self.act_export_range = QAction("Export this range…", self)
        self.act_export_range.triggered.connect(self.export_range)
        self.menu = QMenu(self)  # the plots' right-click menu
        self.menu.addAction(self.act_export_range)
        self.menu.addAction("Clear the range", self.clear_range)
        self.menu.addSeparator()
        self.menu.addAction(self.act_wall_clock)
        self.menu.addAction("Fit all (F)", self.fit)

    def show_menu(self, global_pos) -> None:
        self.act_export_range.setEnabled(self.range_steps is not None)
        self.act_export_range.setText("Export this range…" if self.range_steps else
                                      "Export this range… (shift+drag to select one)")
        self.menu.popup(global_pos)

    def _right_click(self, event) -> None:
        """The menu opens on a right click's release, not its press: a right drag still zooms."""
        if event.type() == QEvent.MouseButtonPress:
            self._right_from = event.position()
        elif self._right_from is not None:
            moved = (event.position() - self._right_from).manhattanLength()
            self._right_from = None
            if moved < 4:
                self.show_menu(event.globalPosition().toPoint())

    def _select_range(self, event) -> bool:
        """Shift+drag selects a range of steps and shows its numbers (a plain drag pans)."""
        if event.type() == QEvent.MouseButtonPress:
            if (not event.modifiers() & Qt.ShiftModifier or event.button() != Qt.LeftButton
                    or not len(self.x)):
                return False
            x = self.time_plot.vb.mapSceneToView(self.glw.mapToScene(event.position().toPoint()))
            self._drag_from = x.x()
        if self._drag_from is None:
            return False
        x = self.time_plot.vb.mapSceneToView(
            self.glw.mapToScene(event.position().toPoint())).x()
        lo, hi = sorted((self._drag_from, x))
        self.region.setRegion((lo, hi))
        self.region.show()
        a, b = self.index_at(lo), self.index_at(hi) + 1  # the steps under both ends and between
        steps = self.data["step"]
        self.range_steps = (int(steps[a]), int(steps[b - 1]))
        self.range_label.setText(range_stats(self.data, a, b, self.markers.steps[ev.EVICTED]))
        self.range_box.show()
        if event.type() == QEvent.MouseButtonRelease:
            self._drag_from = None
        return True

    def _show_range(self, first: int, last: int) -> None:
        """The range of steps first..last, selected again (on the other x axis)."""
        steps = self.data["step"]
        a, b = int(np.searchsorted(steps, first)), int(np.searchsorted(steps, last, "right"))
        self.region.setRegion((float(self.step_x(first)), float(self.step_x(last))))
        self.range_label.setText(range_stats(self.data, a, b, self.markers.steps[ev.EVICTED]))

    def clear_range(self) -> None:
        self.range_steps = None
        self.region.hide()
        self.range_box.hide()

    def export_range(self) -> None:
        """Ask the window to export the selected range (it knows the session behind it)."""
        if self.range_steps is not None:
            self.export_range_requested.emit(*self.range_steps)
