"""Timeline: per-step prefill|decode time (stacked), tokens and batch size (its own axis),
blocks used/cached/free, and the cumulative token hit rate; x linked, zoom and pan, click
selects. It follows the newest step until the user zooms or pans (then a Follow button;
double-click or F fits all); the mouse shows every value at its step; events are marked.
x is the step number, or seconds since the first step (the wall-clock axis, T); a shift-drag
selects a range of steps, shows its numbers and offers to export it."""

from __future__ import annotations

import time

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QEvent, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QMenu,
    QPushButton,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from kvscope.app import palette
from kvscope.app.frames import Frame
from kvscope.app.panels.plot_grid import Grid
from kvscope.app.panels.timeline_parts import (
    MARKERS,
    EventMarkers,
    SpacedAxis,
    StepAxis,
    range_stats,
    readout,
)
from kvscope.app.selection import Selection
from kvscope.engine import events as ev
from kvscope.engine.metrics import StepRecord

FIELDS = ("step", "start_s", "wall_s", "prefill_ms", "decode_ms", "prefill_tokens",
          "decode_tokens", "batch", "active", "cached", "free", "hit_tokens", "query_tokens")
# New steps narrower than a pixel (10,000 steps on 1,500 px) wait for more, at most this long
# (a timer draws them when steps stop coming): redrawing the curves costs the same for one new
# step as for a pixel's worth of them.
MAX_WAIT_S = 0.25
LABELS_MIN_HEIGHT = 300  # px of timeline under which the axis titles are hidden
HOVER_HINT = ("Hover a step for its values; drag or wheel to pan and zoom, F or double-click "
              "fits; shift+drag selects a range; T switches the x axis to seconds; right-click "
              "for more")
STEP_LABEL, SECONDS_LABEL = "step", "seconds since the first step"


def _runs(y: np.ndarray, n: int) -> tuple[int, np.ndarray, np.ndarray]:
    """The max and the min of each run of n samples, the last sample of the run before and the
    first of the run after included (the line from a neighbour crosses into the run's pixel:
    without them, runs shorter than the data's period leave gaps), and where the runs end.
    The last sample is never in a run: a curve ends on it."""
    runs = (len(y) - 1) // n
    end = runs * n
    block = y[:end].reshape(runs, n)
    hi, lo = block.max(axis=1), block.min(axis=1)
    after = y[n : end + 1 : n]  # the first sample after each run
    hi, lo = np.maximum(hi, after), np.minimum(lo, after)
    before = y[n - 1 : end - 1 : n]  # the last sample before each run but the first
    hi[1:], lo[1:] = np.maximum(hi[1:], before), np.minimum(lo[1:], before)
    return end, hi, lo


def _columns(x: np.ndarray, y: np.ndarray, width: int) -> tuple[np.ndarray, ...]:
    """For x that is not evenly spaced (seconds): x[0]..x[-1] cut into `width` equal columns;
    each column's left edge, and the max and min of the line through every sample inside it:
    its samples, and the line's values where it enters and leaves the column (a neighbour
    pixels away does not count, as a neighbour does in _runs; a column with no sample gets the
    line crossing it)."""
    edges = np.linspace(x[0], x[-1], width + 1)
    at_edges = np.interp(edges, x, y)
    hi = np.maximum(at_edges[:-1], at_edges[1:])
    lo = np.minimum(at_edges[:-1], at_edges[1:])
    idx = np.searchsorted(x, edges)
    idx[-1] = len(x) - 1  # the last sample is in no column: a curve ends on it
    full = idx[1:] > idx[:-1]
    if full.any():
        inner, starts = y[: len(x) - 1], idx[:-1][full]
        hi[full] = np.maximum(hi[full], np.maximum.reduceat(inner, starts))
        lo[full] = np.minimum(lo[full], np.minimum.reduceat(inner, starts))
    return edges[:-1], hi, lo


def _envelope(x, y, n: int, width: int | None):
    """(x of each run, its max, its min, x and y of the samples after the runs): runs of n
    samples (x evenly spaced, width None) or pixel columns (see _columns)."""
    if width is None:
        end, hi, lo = _runs(y, n)
        return x[:end:n], hi, lo, x[end:], y[end:]
    left, hi, lo = _columns(x, y, width)
    return left, hi, lo, x[-1:], y[-1:]


def _spans(x: np.ndarray, stop: np.ndarray, y: np.ndarray, box: bool):
    """Each step drawn over the time it ran, from its start x to its stop: a box from 0 (box)
    or a flat line (a staircase through the steps)."""
    if box:
        ys = np.zeros((len(y), 4))
        ys[:, 1] = ys[:, 2] = y
        return np.column_stack([x, x, stop, stop]).ravel(), ys.ravel()
    return np.column_stack([x, stop]).ravel(), np.repeat(y, 2)


def _peaks(x: np.ndarray, y: np.ndarray, n: int,
           width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The max and the min of each run of n samples (at the run's first x), then the last
    samples as they are: at n samples per pixel, the envelope of the line through them all.
    With width, runs are pixel columns instead (x in seconds, see _columns)."""
    if n <= 1 and width is None:
        return x, y
    xs, hi, lo, tx, ty = _envelope(x, y, n, width)
    runs = len(hi)
    px = np.empty(2 * runs + len(tx))
    py = np.empty_like(px)
    px[: 2 * runs : 2] = px[1 : 2 * runs : 2] = xs
    py[: 2 * runs : 2], py[1 : 2 * runs : 2] = hi, lo
    px[2 * runs :], py[2 * runs :] = tx, ty
    return px, py


def _bars(x: np.ndarray, y: np.ndarray, n: int,
          width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Vertical segments from 0 to the max of each run of n samples (or pixel column, with
    width), for a line item drawing pairs: at a run or more per pixel they fill the area under
    the curve, for a fraction of the cost of filling a path."""
    xs, hi, _, tx, ty = _envelope(x, y, n, width)
    tops = np.concatenate([hi, ty])
    xs = np.concatenate([xs, tx])
    bx, by = np.repeat(xs, 2), np.zeros(2 * len(tops))
    by[1::2] = tops
    return bx, by


class Timeline(QWidget):
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
        # One line: the legend, or the values at the step under the mouse.
        self.readout = QLabel()
        self.readout.setToolTip(HOVER_HINT)
        self.readout.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        self.follow_button = QPushButton("Follow ⇥")
        self.follow_button.setToolTip("Show every step and follow the newest again "
                                      "(double-click or F)")
        self.follow_button.clicked.connect(self.fit)
        self.follow_button.hide()
        # A shift-dragged range: its numbers, and its export.
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
        top = QHBoxLayout()
        top.addWidget(self.readout, 1)
        top.addWidget(self.follow_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.setSpacing(1)
        layout.addLayout(top)
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
        self.act_export_range = QAction("Export this range…", self)
        self.act_export_range.triggered.connect(self.export_range)
        self.menu = QMenu(self)  # the plots' right-click menu
        self.menu.addAction(self.act_export_range)
        self.menu.addAction("Clear the range", self.clear_range)
        self.menu.addSeparator()
        self.menu.addAction(self.act_wall_clock)
        self.menu.addAction("Fit all (F)", self.fit)
        self.grids: list[Grid] = []
        self.time_plot = self._plot(0, "ms / step", "Forward time per step: prefill (blue) "
                                    "stacked under decode (pink)")
        self.token_plot = self._plot(1, "tokens", "Tokens per step (prefill + decode) and batch "
                                     "size (sequences in the step)")
        self.block_plot = self._plot(2, "blocks", "Blocks active (blue), cached (green) and "
                                     "free (grey) after each step; dead (dashed magenta, in "
                                     "lab replays): cached but unreachable")
        self.hit_plot = self._plot(3, "hit %", "Token hit rate so far: prompt tokens served "
                                   "from the cache / prompt tokens looked up", ticks=(0, 50, 100),
                                   bottom=StepAxis("bottom"))
        self.x_axis = self.hit_plot.getAxis("bottom")
        for p in (self.token_plot, self.block_plot, self.hit_plot):
            p.setXLink(self.time_plot)
        self.hit_plot.setYRange(0, 100, padding=0.05)
        self.hit_plot.setLabel("bottom", STEP_LABEL)
        for p in (self.time_plot, self.token_plot, self.block_plot):
            p.hideAxis("bottom")
        # Filled lines rather than step curves, given the min and max of the steps under each
        # pixel (see _redraw). Width-1 cosmetic pens: wide lines cost several times more.
        self.total_curve = self._curve(self.time_plot, palette.DECODE_COLOR, "decode", fill=True)
        self.prefill_curve = self._curve(self.time_plot, palette.PREFILL_COLOR, "prefill",
                                         fill=True)
        self.tokens_curve = self._curve(self.token_plot, "#444444", "tokens")
        self.batch_view = self._right_axis(self.token_plot, "batch")  # its own scale
        self.batch_curve = pg.PlotDataItem(pen=pg.mkPen(palette.SHARED_COLOR))
        self.batch_view.addItem(self.batch_curve)
        self.active_curve = self._curve(self.block_plot, palette.ACTIVE_COLOR, "active")
        self.cached_curve = self._curve(self.block_plot, palette.CACHED_COLOR, "cached")
        self.free_curve = self._curve(self.block_plot, "#999999", "free")
        # dead cache (sampled by sources that know it): resident blocks no lookup can reach
        self.dead_curve = self.block_plot.plot(
            pen=pg.mkPen(palette.DEAD_OUTLINE, style=pg.QtCore.Qt.PenStyle.DashLine))
        self.hit_curve = self._curve(self.hit_plot, palette.CACHED_COLOR, "token hit rate")
        self.markers = EventMarkers(self.time_plot)  # after the curves: drawn over them
        self.time_plot.addItem(self.region)
        self.legend = self._legend_html()
        self.readout.setText(self.legend)
        # Zoomed out, the filled curves are drawn as a bar per pixel instead (see _bars).
        self.total_bars = self._bars(self.time_plot, palette.DECODE_COLOR)
        self.prefill_bars = self._bars(self.time_plot, palette.PREFILL_COLOR)
        self.cursors, self.hover_lines = [], []
        for p in (self.time_plot, self.token_plot, self.block_plot, self.hit_plot):
            for lines, pen in ((self.cursors, pg.mkPen("#000000", width=1)),
                               (self.hover_lines, pg.mkPen("#888888", width=1, style=Qt.DashLine))):
                line = pg.InfiniteLine(angle=90, movable=False, pen=pen)
                line.hide()
                p.addItem(line)
                lines.append(line)
        self.glw.scene().sigMouseClicked.connect(self._on_click)
        self.glw.scene().sigMouseMoved.connect(self._on_hover)
        self.glw.viewport().installEventFilter(self)  # leaving, double-click
        self.data = {f: np.zeros(0) for f in FIELDS}
        self.x = self.data["step"]  # each step's x: its number, or its start in seconds
        self._dead: tuple[np.ndarray, np.ndarray] | None = None  # (steps, dead blocks)
        self._cursor_step: int | None = None
        self._hit = self._query = 0
        self._pending = 0  # steps in self.data not drawn yet
        self._drawn_at = -np.inf
        self._flush = QTimer(self, singleShot=True, interval=int(MAX_WAIT_S * 1000))
        self._flush.timeout.connect(self._redraw)
        self._batch_top = self._tokens_top = 0.0
        self._shown: tuple | None = None  # what the curves hold: (follow, first, end, width)
        self.time_plot.vb.sigXRangeChanged.connect(self._on_x_range)
        self.time_plot.vb.sigResized.connect(self._on_x_range)

    def _plot(self, row: int, label: str, tip: str, ticks=None, bottom=None) -> pg.PlotItem:
        axes = {"left": SpacedAxis("left"), "right": SpacedAxis("right")}
        if bottom is not None:
            axes["bottom"] = bottom
        p = self.glw.addPlot(row=row, col=0, axisItems=axes)
        p.setLabel("left", label)
        p.showAxis("right")  # every plot has one, so their x axes line up with the batch axis
        p.getAxis("right").setWidth(40)
        p.getAxis("right").setStyle(showValues=False)
        if ticks is not None:  # a short plot: a few round ticks rather than a crowded axis
            p.getAxis("left").setTicks([[(v, str(v)) for v in ticks]])
        p.getAxis("left").setWidth(56)
        p.setToolTip(tip)
        self.grids.append(Grid(p, y_ticks=ticks))  # showGrid costs more than the curves
        for name in ("left", "bottom", "right", "top"):  # no units: no prefix to relabel on steps
            p.getAxis(name).enableAutoSIPrefix(False)
        p.setMenuEnabled(False)
        p.setMouseEnabled(x=True, y=False)
        return p

    @staticmethod
    def _curve(plot: pg.PlotItem, color: str, name: str, fill: bool = False) -> pg.PlotDataItem:
        return plot.plot(pen=pg.mkPen(color), fillLevel=0 if fill else None,
                         brush=pg.mkBrush(color) if fill else None, name=name)

    def _legend_html(self) -> str:
        """Every curve and marker, in one line above the plots (a legend inside a plot covers
        its curves)."""
        curves = [(self.prefill_curve, "prefill ms"), (self.total_curve, "decode ms"),
                  (self.tokens_curve, "tokens"), (self.batch_curve, "batch (right axis)"),
                  (self.active_curve, "active"), (self.cached_curve, "cached"),
                  (self.free_curve, "free"), (self.hit_curve, "hit %")]
        items = [f"<span style='color:{c.opts['pen'].color().name()}'>━</span>&nbsp;{name}"
                 for c, name in curves]
        glyphs = {"t": "▼", "d": "◆", "x": "✖", "s": "■"}
        items += [f"<span style='color:{color}'>{glyphs[symbol]}</span>&nbsp;{label}"
                  for symbol, color, label in MARKERS.values()]
        return "&nbsp;&nbsp; ".join(items)

    @staticmethod
    def _right_axis(plot: pg.PlotItem, label: str) -> pg.ViewBox:
        """A second y scale on the plot's right axis, sharing its x."""
        view = pg.ViewBox(enableMouse=False)
        plot.scene().addItem(view)
        axis = plot.getAxis("right")
        axis.setStyle(showValues=True)
        axis.linkToView(view)
        axis.setLabel(label)
        axis.enableAutoSIPrefix(False)
        view.setXLink(plot)
        plot.vb.sigResized.connect(lambda: view.setGeometry(plot.vb.sceneBoundingRect()))
        return view

    @staticmethod
    def _bars(plot: pg.PlotItem, color: str) -> pg.PlotCurveItem:
        bars = pg.PlotCurveItem(pen=pg.mkPen(color), connect="pairs", antialias=False)
        plot.addItem(bars)
        return bars

    def show_frame(self, frame: Frame) -> None:
        self.redrew = self.add_records(frame.records)  # first: the markers' steps have an x
        if frame.dead_counts is not None:
            self._dead = frame.dead_counts
            self.dead_curve.setData(self.step_x(self._dead[0]), self._dead[1])
        self.markers.add(frame.events)

    def clear(self) -> None:
        self._dead = None
        self.dead_curve.setData([], [])
        self.data = {f: np.zeros(0) for f in FIELDS}
        self.x = self.data["step"]
        self._hit = self._query = 0
        self.markers.clear()
        self.clear_range()
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
        self.x_axis.seconds = on
        self.x_axis.picture = None  # its ticks are computed anew
        self.x_axis.setLabel(SECONDS_LABEL if on else STEP_LABEL)
        self.x_axis.showLabel(self.height() >= LABELS_MIN_HEIGHT)  # setLabel shows it
        self.markers.to_x = self.step_x
        self.markers.place()
        if self._dead is not None:
            self.dead_curve.setData(self.step_x(self._dead[0]), self._dead[1])
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
        # Short plots have no room for their rotated axis titles (they would overlap): the
        # legend line names the curves instead.
        tall = self.height() >= LABELS_MIN_HEIGHT
        for p in (self.time_plot, self.token_plot, self.block_plot, self.hit_plot):
            p.getAxis("left").showLabel(tall)
        self.x_axis.showLabel(tall)  # the ticks say "s" on the wall-clock axis
        self.token_plot.getAxis("right").showLabel(tall)  # "batch": the legend says it too
        hit_ticks = (0, 50, 100) if tall else (0, 100)  # three labels would overlap
        self.hit_plot.getAxis("left").setTicks([[(v, str(v)) for v in hit_ticks]])

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
        if self.wall_clock:  # steps that came after their events or the cursor get their x
            self.markers.place()
            self.set_cursor(self._cursor_step)
        top = max(1.0, float(d["batch"].max())) if len(d["batch"]) else 1.0
        if top != self._batch_top:  # the batch axis starts at 0, as the tokens axis does
            self._batch_top = top
            self.batch_view.setYRange(0, top, padding=0.05)
        shown = next(ys for c, _, ys in series if c is self.tokens_curve)
        top = max(1.0, float(np.max(shown))) if len(shown) else 1.0
        if top != self._tokens_top:  # from 0: a steady 1,024 tokens is not "1023.5 to 1024.5"
            self._tokens_top = top
            self.token_plot.setYRange(0, top, padding=0.05)

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
        for p in (self.time_plot, self.token_plot, self.block_plot, self.hit_plot):
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
            self.readout.setText(readout(self.data, i,
                                         self.markers.at(int(self.data["step"][i]))))

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

    _right_from = None

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
            self.readout.setText(self.legend)
        elif event.type() == QEvent.MouseButtonDblClick:
            self.fit()
        elif event.type() in (QEvent.MouseButtonPress, QEvent.MouseMove,
                              QEvent.MouseButtonRelease):
            return self._select_range(event)
        return False

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

    def _on_click(self, event) -> None:
        i = self._step_index(event.scenePos())
        if i is not None:
            self.step_clicked.emit(int(self.data["step"][i]))
