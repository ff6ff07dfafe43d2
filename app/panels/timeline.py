"""Timeline: per-step prefill|decode time (stacked), tokens and batch size (its own axis),
blocks used/cached/free, and the cumulative token hit rate; x linked, zoom and pan, click
selects. It follows the newest step until the user zooms or pans (then a Follow button;
double-click or F fits all); the mouse shows every value at its step; events are marked.
x is the step number, or seconds since the first step (the wall-clock axis, T); a shift-drag
selects a range of steps, shows its numbers and offers to export it (timeline_range.py). Every
line is a named series (timeline_series.py: `add_series` for lines of other owners), in the
legend line above the plots; timeline_envelope.py reduces the curves to what pixels show."""

from __future__ import annotations

import time

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QEvent, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QKeySequence, QShortcut
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QSizePolicy, QVBoxLayout, QWidget

from kvscope.app import palette
from kvscope.app.frames import Frame
from kvscope.app.panels.timeline_envelope import _bars, _peaks, _spans
from kvscope.app.panels.timeline_groups import GroupLines
from kvscope.app.panels.timeline_parts import EventMarkers, readout
from kvscope.app.panels.timeline_range import RangeSelection
from kvscope.app.panels.timeline_series import (
    BATCH_LABEL,
    PLOTS,
    SeriesPlots,
)
from kvscope.app.panels.timeline_transfers import TransferLines
from kvscope.app.selection import Selection
from kvscope.engine.metrics import StepRecord

__all__ = ["MAX_WAIT_S", "PLOTS", "SECONDS_LABEL", "STEP_LABEL", "Timeline", "_bars", "_peaks"]

FIELDS = ("step", "start_s", "wall_s", "prefill_ms", "decode_ms", "prefill_tokens",
          "decode_tokens", "batch", "active", "cached", "free", "hit_tokens", "query_tokens")
# New steps narrower than a pixel (10,000 steps on 1,500 px) wait for more, at most this long
# (a timer draws them when steps stop coming): redrawing the curves costs the same for one new
# step as for a pixel's worth of them.
MAX_WAIT_S = 0.25
HOVER_HINT = ("Hover a step for its values; drag or wheel to pan and zoom, F or double-click "
              "fits; shift+drag selects a range; T switches the x axis to seconds; right-click "
              "for more")
STEP_LABEL, SECONDS_LABEL = "step", "seconds since the first step"


class Timeline(GroupLines, TransferLines, SeriesPlots, RangeSelection, QWidget):
    step_clicked = Signal(int)
    export_range_requested = Signal(int, int)  # the first and last step of the range shown

    def __init__(self, selection: Selection | None = None, parent=None):
        super().__init__(parent)
        self.selection = selection or Selection()
        self.step_clicked.connect(self.selection.select_step)
        self.selection.step_changed.connect(self.set_cursor)
        self.redrew = False  # the last frame redrew the curves (the costly case)
        self.glw = pg.GraphicsLayoutWidget()
        self.glw.setBackground("w")
        self.glw.ci.setContentsMargins(0, 2, 0, 0)  # the plots get every pixel of a short dock
        self.glw.ci.layout.setVerticalSpacing(0)
        # Two lines: the legend (always), and the values at the step under the mouse.
        self.legend_line = QLabel()
        self.legend_line.setToolTip("What each line and marker is")
        self.readout = QLabel(HOVER_HINT)
        self.readout.setToolTip(HOVER_HINT)
        self.readout.setStyleSheet(f"color: {palette.MUTED}")
        for label in (self.legend_line, self.readout):
            label.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        self.follow_button = QPushButton("Follow ⇥")
        self.follow_button.setToolTip("Show every step and follow the newest again "
                                      "(double-click or F)")
        self.follow_button.clicked.connect(self.fit)
        self.follow_button.hide()
        self._init_range()  # a shift-dragged range: its numbers, and its export
        top = QHBoxLayout()
        top.addWidget(self.legend_line, 1)
        top.addWidget(self.follow_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.setSpacing(1)
        layout.addLayout(top)
        layout.addWidget(self.readout)
        layout.addWidget(self.range_box)
        layout.addWidget(self.glw)
        QShortcut(QKeySequence("F"), self, self.fit, context=Qt.WidgetWithChildrenShortcut)
        self.wall_clock = False  # x in seconds since the first step, rather than steps
        self.act_wall_clock = QAction("Wall-clock x axis (seconds)", self, checkable=True)
        self.act_wall_clock.setShortcut(QKeySequence("T"))
        self.act_wall_clock.setShortcutContext(Qt.WindowShortcut)  # the window's View menu too
        self.act_wall_clock.setToolTip("Timeline x axis in seconds since the first step, as in "
                                       "Perfetto, rather than in steps (T)")
        self.act_wall_clock.toggled.connect(self.set_wall_clock)
        self.addAction(self.act_wall_clock)
        self._init_menu()
        self._init_series()
        self.time_plot = self._plot("time", "ms", "Forward time per step: prefill (blue) "
                                    "stacked under decode (pink)")
        self.token_plot = self._plot("tokens", "tokens", "Tokens per step (prefill + decode) "
                                     "and batch size (sequences in the step)")
        self.block_plot = self._plot("blocks", "blocks", "Blocks active (blue), cached (green) "
                                     "and free (grey) after each step; dead (dashed magenta, "
                                     "where the source knows it): cached but unreachable")
        self.hit_plot = self._plot("hit", "hit %", "Token hit rate so far: prompt tokens served "
                                   "from the cache / prompt tokens looked up", ticks=(0, 50, 100))
        for p in (self.token_plot, self.block_plot, self.hit_plot):
            p.setXLink(self.time_plot)
        self._init_groups()  # the KV-groups plot: lines only for a model with several groups
        self.hit_plot.setYRange(0, 100, padding=0.05)
        for p in self.plots.values():
            p.setLabel("bottom", STEP_LABEL)
        # Filled lines rather than step curves, given the min and max of the steps under each
        # pixel (see _redraw); zoomed out, a bar per pixel. Width-1 cosmetic pens: wide lines
        # cost several times more.
        self.total_curve = self._own_series("decode", self.time_plot, palette.DECODE_COLOR,
                                            "decode ms", fill=True)
        self.prefill_curve = self._own_series("prefill", self.time_plot, palette.PREFILL_COLOR,
                                              "prefill ms", fill=True, legend_order=0)
        self.total_bars = self.series["decode"].items[1]
        self.prefill_bars = self.series["prefill"].items[1]
        self.tokens_curve = self._own_series("tokens", self.token_plot, "#444444", "tokens")
        self.batch_view = self._right_axis(self.token_plot, BATCH_LABEL)  # its own scale
        self.batch_curve = self._own_series("batch", self.batch_view, palette.SHARED_COLOR,
                                            "batch (right axis)")
        self.active_curve = self._own_series("active", self.block_plot, palette.ACTIVE_COLOR,
                                             "active")
        self.cached_curve = self._own_series("cached", self.block_plot, palette.CACHED_COLOR,
                                             "cached")
        self.free_curve = self._own_series("free", self.block_plot, "#999999", "free")
        # dead cache (sampled by sources that know it): resident blocks no lookup can reach
        self.add_series("dead", "blocks", palette.DEAD_OUTLINE, "dead (unreachable)",
                        dashed=True)
        self.dead_curve = self.series["dead"].items[0]
        self.hit_curve = self._own_series("hit", self.hit_plot, palette.CACHED_COLOR, "hit %")
        self._init_transfers()  # the host tier's plot: lines only for a run with a host tier
        self.markers = EventMarkers(self.time_plot)  # after the curves: drawn over them
        # Undrawn, the steps' x extent (no y): following the newest step, the x range is fitted
        # to the time plot's lines, and an attached server shows none there (no forward times).
        self.extent = pg.PlotCurveItem(pen=pg.mkPen(None))
        self.time_plot.addItem(self.extent)
        self.time_plot.addItem(self.region)
        self.plots_menu = self.menu.addMenu("Plots")
        self._init_plots_menu(self.plots_menu)
        self.show_plots(PLOTS)  # all of them; the window shows the user's choice (use_settings)
        self.cursors, self.hover_lines = [], []
        for p in (self.time_plot, self.token_plot, self.block_plot, self.hit_plot):
            self._add_step_lines(p)
        self.glw.scene().sigMouseClicked.connect(self._on_click)
        self.glw.scene().sigMouseMoved.connect(self._on_hover)
        self.glw.viewport().installEventFilter(self)  # leaving, double-click
        self.data = {f: np.zeros(0) for f in FIELDS}
        self.x = self.data["step"]  # each step's x: its number, or its start in seconds
        self._cursor_step: int | None = None
        self._hit = self._query = 0
        self._pending = 0  # steps in self.data not drawn yet
        self._drawn_at = -np.inf
        self._flush = QTimer(self, singleShot=True, interval=int(MAX_WAIT_S * 1000))
        self._flush.timeout.connect(self._redraw)
        self._batch_top = 0.0
        self._readout_of = readout  # the readout's words (set_readout)
        self._shown: tuple | None = None  # what the curves hold: (follow, first, end, width)
        self.time_plot.vb.sigXRangeChanged.connect(self._on_x_range)
        self.time_plot.vb.sigResized.connect(self._on_x_range)

    def _add_step_lines(self, plot: pg.PlotItem) -> None:
        """The plot's cursor (the step shown) and hover line (the step under the mouse)."""
        for lines, pen in ((self.cursors, pg.mkPen("#000000", width=1)),
                           (self.hover_lines, pg.mkPen("#888888", width=1, style=Qt.DashLine))):
            line = pg.InfiniteLine(angle=90, movable=False, pen=pen)
            line.hide()
            plot.addItem(line)
            lines.append(line)

    def show_frame(self, frame: Frame) -> None:
        if frame.snapshot is not None:
            self.name_groups(frame.snapshot.groups)
            if frame.snapshot.host is not None:
                self.offer_transfers()  # a host tier, even before its first copy
        self.redrew = self.add_records(frame.records)  # first: the markers' steps have an x
        if frame.dead_counts is not None:  # a flat 0 is not drawn (nor listed)
            steps, counts = frame.dead_counts
            flat = not np.any(np.asarray(counts))
            self.set_series("dead", [] if flat else steps, [] if flat else counts)
        self.markers.add(frame.events)

    def clear(self) -> None:
        self.clear_series()
        self.data = {f: np.zeros(0) for f in FIELDS}
        self.x = self.data["step"]
        self._hit = self._query = 0
        self.markers.clear()
        self._clear_groups()
        self._clear_transfers()
        self.clear_range()
        self.time_plot.setXRange(0, 1, padding=0)  # not the last run's steps: nothing yet
        self.fit()  # a new run: follow it again
        self._redraw()

    # ------------------------------------------------------------ x: steps or seconds
    def _x_of(self, data: dict[str, np.ndarray]) -> np.ndarray:
        if not self.wall_clock or not len(data["step"]):
            return data["step"]
        return data["start_s"] - data["start_s"][0]

    def step_x(self, steps):
        """Where steps are on x (their start, in seconds since the first step, on the
        wall-clock axis; steps not shown yet are put at the nearest one shown)."""
        if not self.wall_clock or not len(self.x):
            return steps
        return np.interp(steps, self.data["step"], self.x)

    def index_at(self, x: float) -> int:
        """The sample at x: by step, the nearest; by time, the step running then (between two
        steps, the nearer)."""
        xs = self.x
        if not self.wall_clock:
            return int(np.abs(xs - x).argmin())
        i = max(0, int(np.searchsorted(xs, x, side="right")) - 1)
        end = xs[i] + self.data["wall_s"][i]
        if x > end and i + 1 < len(xs) and xs[i + 1] - x < x - end:
            i += 1
        return i

    def set_wall_clock(self, on: bool) -> None:
        """x in seconds since the first step (True) or in steps; the view keeps the same steps
        in sight, and the cursor, markers and range move with them."""
        if on == self.wall_clock:
            return
        (x0, x1), _ = self.time_plot.vb.viewRange()
        old = self.x
        self.wall_clock = on
        self.act_wall_clock.setChecked(on)
        self.x = self._x_of(self.data)
        for p in self.plots.values():
            axis = p.getAxis("bottom")
            axis.seconds = on
            axis.picture = None  # its ticks are computed anew
            axis.setLabel(SECONDS_LABEL if on else STEP_LABEL)
        self._update_titles()  # setLabel shows them
        self.markers.to_x = self.step_x
        self.markers.place()
        self._place_series()
        self.set_cursor(self._cursor_step)
        for line in self.hover_lines:
            line.hide()
        if self.range_steps is not None:
            self._show_range(*self.range_steps)
        self._shown = None
        if not self.following and len(old) > 1:
            self.time_plot.setXRange(*np.interp([x0, x1], old, self.x), padding=0)
        else:
            self._redraw()
            self.time_plot.vb.updateAutoRange()  # now, not at the next paint: x changed units

    @property
    def following(self) -> bool:
        return bool(self.time_plot.vb.autoRangeEnabled()[0])

    def fit(self) -> None:
        """Every step in view, and the newest followed as it comes."""
        self.time_plot.enableAutoRange(x=True)
        self.follow_button.hide()

    def add_records(self, records: list[StepRecord]) -> bool:
        """Append steps; returns whether the curves were redrawn now (a pixel's worth of new
        steps, or the oldest waited MAX_WAIT_S), the costly case."""
        if not records:
            return False
        cols = {
            "step": [r.step for r in records],
            "start_s": [r.start_s for r in records],
            "wall_s": [r.wall_s for r in records],
            "prefill_ms": [r.prefill_s * 1e3 for r in records],
            "decode_ms": [r.decode_s * 1e3 for r in records],
            "prefill_tokens": [r.prefill_tokens for r in records],
            "decode_tokens": [r.decode_tokens for r in records],
            "batch": [r.batch_size for r in records],
            "active": [r.num_active_blocks for r in records],
            "cached": [r.num_cached_blocks for r in records],
            "free": [r.num_free_blocks for r in records],
            "hit_tokens": np.cumsum([r.hit_tokens for r in records]) + self._hit,
            "query_tokens": np.cumsum([r.query_tokens for r in records]) + self._query,
        }
        self._hit, self._query = int(cols["hit_tokens"][-1]), int(cols["query_tokens"][-1])
        for f in FIELDS:
            self.data[f] = np.concatenate([self.data[f], np.asarray(cols[f], dtype=np.float64)])
        self._add_group_records(records)
        self._add_transfer_records(records)
        self.x = self._x_of(self.data)
        self._pending += len(records)
        if not self.isVisible():
            return False  # drawn when shown
        if (self._pending * self._pixels_per_step() >= 1
                or time.monotonic() - self._drawn_at >= MAX_WAIT_S):
            self._redraw()
            return True
        self._flush.start()  # restarted: it fires only once steps stop coming
        return False

    def _pixels_per_step(self) -> float:
        (x0, x1), _ = self.time_plot.vb.viewRange()
        if not self.wall_clock:
            return self.time_plot.vb.width() / max(x1 - x0, 1e-9)
        shown = np.searchsorted(self.x, x1, side="right") - np.searchsorted(self.x, x0)
        return self.time_plot.vb.width() / max(int(shown), 1)

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt API
        super().resizeEvent(event)
        self._update_titles()

    def showEvent(self, event) -> None:  # noqa: N802 - Qt API
        super().showEvent(event)
        if self._pending:
            self._redraw()

    def _redraw(self) -> None:
        """Give the curves the steps in view, reduced to the max and min of the steps under each
        pixel: while the view follows the data, all of them; zoomed in, those in the view."""
        self._pending, self._drawn_at = 0, time.monotonic()
        self._flush.stop()
        d = self.data
        x = self.x
        q = d["query_tokens"]
        series = [
            (self.total_curve, d["prefill_ms"] + d["decode_ms"]),
            (self.prefill_curve, d["prefill_ms"]),
            (self.tokens_curve, d["prefill_tokens"] + d["decode_tokens"]),
            (self.batch_curve, d["batch"]),
            (self.active_curve, d["active"]),
            (self.cached_curve, d["cached"]),
            (self.free_curve, d["free"]),
            (self.hit_curve, np.divide(100 * d["hit_tokens"], q, out=np.zeros_like(q),
                                       where=q > 0)),
            *self._group_lines(),
            *self._transfer_lines(),
        ]
        vb = self.time_plot.vb
        follow = bool(vb.autoRangeEnabled()[0])
        first, end = 0, len(x)
        if not follow:  # one step beyond each edge, so the lines reach them
            lo, hi = vb.viewRange()[0]
            first = max(0, int(np.searchsorted(x, lo)) - 1)
            end = min(len(x), int(np.searchsorted(x, hi, side="right")) + 1)
        width = max(1, int(vb.width()))
        self._shown = (follow, first, end, width)
        self.extent.setData(x[[first, end - 1]] if end > first else [],  # y: none (NaN)
                            np.full(2, np.nan) if end > first else [])
        per_pixel = (end - first) // width
        columns = None
        bars = {self.total_curve: self.total_bars, self.prefill_curve: self.prefill_bars}
        if self.wall_clock:  # each step over the time it ran (to the next step's start at most)
            after = x[end] if end < len(x) else np.inf
            stop = np.minimum(x[first:end] + d["wall_s"][first:end],
                              np.append(x[first + 1 : end], after))
            series = [(c, *_spans(x[first:end], stop, y[first:end], c in bars)) for c, y in series]
        else:
            series = [(c, x[first:end], y[first:end]) for c, y in series]
        for curve, xs, ys in series:
            if self.wall_clock:  # seconds are not evenly spaced: pixel columns, not runs
                per_pixel = len(xs) // width
                columns = width if per_pixel >= 2 else None
            if curve in bars and per_pixel >= 2:
                bars[curve].setData(*_bars(xs, ys, per_pixel, columns))
                curve.setData([], [])
                continue
            if curve in bars:
                bars[curve].setData([], [])
            curve.setData(*_peaks(xs, ys, per_pixel, columns))
        if self.wall_clock:  # steps that came after their events, series, cursor get their x
            self.markers.place()
            self._place_series()
            self.set_cursor(self._cursor_step)
        top = max(1.0, float(d["batch"].max())) if len(d["batch"]) else 1.0
        if top != self._batch_top:  # the batch axis starts at 0, as the tokens axis does
            self._batch_top = top
            self.batch_view.setYRange(0, top, padding=0.05)
        shown = next(ys for c, _, ys in series if c is self.tokens_curve)
        self._tokens_shown = float(np.max(shown)) if len(shown) else 0.0
        self._fit_tokens_axis()

    def _on_x_range(self, *_) -> None:
        """Zoomed or panned (or resized): the curves get the steps now in view."""
        self.follow_button.setVisible(not self.following)
        if self._shown is None or not len(self.data["step"]):
            return
        follow = self.following
        if follow and self._shown[0] and self._shown[3] == max(1, int(
                self.time_plot.vb.width())):
            return  # the view follows the data the curves already hold
        self._redraw()

    def set_cursor(self, step: int | None) -> None:
        self._cursor_step = step
        for line in self.cursors:
            line.setVisible(step is not None)
            if step is not None:
                line.setValue(float(self.step_x(step)))

    def _step_index(self, scene_pos) -> int | None:
        """The sample at the x under a scene point (see index_at), if the point is on a plot."""
        for p in self.plots.values():
            if len(self.x) and p.sceneBoundingRect().contains(scene_pos):
                return self.index_at(p.vb.mapSceneToView(scene_pos).x())
        return None

    def _on_hover(self, scene_pos) -> None:
        i = self._step_index(scene_pos)
        for line in self.hover_lines:
            line.setVisible(i is not None)
            if i is not None:
                line.setValue(self.x[i])
        if i is not None:
            self.readout.setText(self._readout_of(self.data, i, self.markers.at(
                int(self.data["step"][i]))) + self._groups_readout(i)
                + self._transfers_readout(i))

    def set_readout(self, text_of=None) -> None:
        """What the readout says at the step under the mouse: text_of(data, i, events), in the
        words of what is shown (an attached server's); None: every own curve's value."""
        self._readout_of = text_of or readout

    def eventFilter(self, watched, event) -> bool:  # noqa: N802 - Qt API
        if event.type() == QEvent.ContextMenu:
            if event.reason() != event.Reason.Mouse:  # the menu key; the mouse's: on release
                self.show_menu(watched.mapToGlobal(watched.rect().center()))
            return True
        if (event.type() in (QEvent.MouseButtonPress, QEvent.MouseButtonRelease)
                and event.button() == Qt.RightButton):
            self._right_click(event)
            return False
        if event.type() == QEvent.Leave:
            for line in self.hover_lines:
                line.hide()
            self.readout.setText(HOVER_HINT)
        elif event.type() == QEvent.MouseButtonDblClick:
            self.fit()
        elif event.type() in (QEvent.MouseButtonPress, QEvent.MouseMove,
                              QEvent.MouseButtonRelease):
            return self._select_range(event)
        return False

    def _on_click(self, event) -> None:
        i = self._step_index(event.scenePos())
        if i is not None:
            self.step_clicked.emit(int(self.data["step"][i]))
