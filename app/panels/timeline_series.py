"""The timeline's plots and its named series: every line drawn on the timeline is a series with a
plot, a colour, a style and a legend label, so the legend line names every line shown.

The timeline's own series ("prefill", "decode", "tokens", "batch", "active", "cached", "free",
"hit") are drawn from its step records; any other (`add_series`: the dead-cache count, an
attached server's stored/removed blocks, ...) is given its steps and values by its owner, and
placed on the x axis (steps or seconds) by the timeline. A series can be shown, hidden and
relabelled; plots can be retitled and the batch axis hidden, all without reaching into the plots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QAction

from kvscope.app.panels.plot_grid import Grid
from kvscope.app.panels.timeline_parts import MARKERS, SpacedAxis, StepAxis

# top to bottom; "batch": the tokens plot's right axis; "groups" only for a model with several
# KV-cache groups (timeline_groups.py), "transfers" only for a run with a host tier
# (timeline_transfers.py)
PLOTS = ("time", "tokens", "blocks", "groups", "transfers", "hit")
BATCH_LABEL = "batch"
# What the user can show (the View menu and the plots' right-click menu; kept in QSettings);
# the time plot always is (it holds the x range, the events and the selected range).
PLOT_NAMES = {"time": "Forward time per step", "tokens": "Tokens and batch size",
              "blocks": "Blocks (active, cached, free)",
              "groups": "KV groups (blocks per group, freed by the window)",
              "transfers": "Transfers (blocks to and from the host tier, copy time)",
              "hit": "Token hit rate"}
DEFAULT_PLOTS = ("time", "blocks")  # two plots fit a short dock with their titles
PLOTS_KEY = "timeline/plots"
TITLE_MIN_HEIGHT = 64  # px per plot shown, and one more, before the x and batch titles show
GLYPHS = {"t": "▼", "d": "◆", "x": "✖", "s": "■"}  # the markers' symbols, as text


@dataclass
class Series:
    plot: str
    color: str  # as the legend writes it (#rrggbb)
    label: str  # in the legend
    default_label: str
    dashed: bool
    items: list  # what is drawn (a filled curve has its bars too)
    own: bool  # drawn from the timeline's records (else from set_series)
    visible: bool = True
    steps: np.ndarray = field(default_factory=lambda: np.zeros(0))
    values: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @property
    def in_legend(self) -> bool:
        """Shown, and drawn: the timeline's own always are; another once it has data."""
        return self.visible and (self.own or len(self.steps) > 0)

    def on(self, plots) -> bool:
        """On one of these plots (the batch line is on the tokens plot)."""
        return ("tokens" if self.plot == "batch" else self.plot) in plots


class SeriesPlots:
    """The plots and series of a Timeline (a mixin: the Timeline is a QWidget with `glw`, a
    pyqtgraph GraphicsLayoutWidget, a `legend_line` label, `batch_view` and `step_x(steps)`)."""

    def _init_series(self) -> None:
        self.plots: dict[str, pg.PlotItem] = {}
        self.series: dict[str, Series] = {}
        self.grids: list[Grid] = []
        self._default_titles: dict[str, str] = {}
        self._default_tips: dict[str, str] = {}
        self._tokens_shown = self._tokens_top = 0.0  # the tokens plot's highest value in view
        self.shown_plots: tuple[str, ...] = PLOTS
        self._chosen: tuple[str, ...] = PLOTS  # the user's (show_plots)
        self._required: tuple[str, ...] = ()  # the source's (require_plots)
        self._settings = None  # where the user's choice is kept (use_settings)
        self.plot_actions: dict[str, QAction] = {}
        self.num_groups = 1  # KV-cache groups of the run shown: the groups plot needs two
        self.has_host_tier = False  # the run shown has a host tier: the transfers plot is offered

    # ------------------------------------------------------------------ plots
    def _plot(self, name: str, label: str, tip: str, ticks=None) -> pg.PlotItem:
        axes = {"left": SpacedAxis("left"), "right": SpacedAxis("right"),
                "bottom": StepAxis("bottom")}  # shown on the lowest plot shown
        p = self.glw.addPlot(row=len(self.plots), col=0, axisItems=axes,
                              enableMenu=False)  # no menus: building one costs ~10 ms
        p.setLabel("left", label)
        p.showAxis("right")  # every plot has one, so their x axes line up with the batch axis
        p.getAxis("right").setWidth(40)
        p.getAxis("right").setStyle(showValues=False)
        if ticks is not None:  # a short plot: a few round ticks rather than a crowded axis
            p.getAxis("left").setTicks([[(v, str(v)) for v in ticks]])
        p.getAxis("left").setWidth(56)
        p.setToolTip(tip)
        self._default_tips[name] = tip
        p.vb.sigResized.connect(self._update_titles)  # a title shows where it fits
        self.grids.append(Grid(p, y_ticks=ticks))  # showGrid costs more than the curves
        for axis in ("left", "bottom", "right", "top"):  # no units: no prefix to relabel on steps
            p.getAxis(axis).enableAutoSIPrefix(False)
        p.setMouseEnabled(x=True, y=False)
        self.plots[name] = p
        self._default_titles[name] = label
        return p

    @staticmethod
    def _right_axis(plot: pg.PlotItem, label: str) -> pg.ViewBox:
        """A second y scale on the plot's right axis, sharing its x."""
        view = pg.ViewBox(enableMouse=False, enableMenu=False)
        plot.scene().addItem(view)
        axis = plot.getAxis("right")
        axis.setStyle(showValues=True)
        axis.linkToView(view)
        axis.setLabel(label)
        axis.enableAutoSIPrefix(False)
        view.setXLink(plot)
        plot.vb.sigResized.connect(lambda: view.setGeometry(plot.vb.sceneBoundingRect()))
        return view

    def _tall(self) -> bool:
        """Room for the x title and the right axis's (a short timeline gives their lines to the
        plots: the ticks show the unit): plots of TITLE_MIN_HEIGHT, and one more."""
        return self.glw.height() >= TITLE_MIN_HEIGHT * (len(self.shown_plots) + 1)

    @staticmethod
    def _title_fits(plot: pg.PlotItem) -> bool:
        """The plot's rotated y title is no longer than the plot is tall."""
        label = plot.getAxis("left").label
        return plot.vb.height() >= label.boundingRect().width()

    @property
    def x_axis(self) -> StepAxis:
        """The x axis shown: under the lowest plot shown."""
        return self.plots[self.shown_plots[-1]].getAxis("bottom")

    def show_plots(self, names) -> None:
        """Show these plots (the time plot always, and those the source shown requires), top to
        bottom in PLOTS' order; the others and their lines leave the layout, and the legend."""
        self._chosen = tuple(n for n in PLOTS if n == "time" or n in names)
        if self._settings is not None:
            self._settings.setValue(PLOTS_KEY, list(self._chosen))
        self._lay_out_plots()

    def require_plots(self, names) -> None:
        """Plots the source shown draws its lines on (an attached server's stored and removed
        blocks): shown whatever the user chose, and not kept as their choice."""
        self._required = tuple(names)
        self._lay_out_plots()

    def _lay_out_plots(self) -> None:
        want = {n for n in set(self._chosen) | set(self._required) if self._offered(n)}
        shown = tuple(n for n in PLOTS if n in want)
        self.shown_plots = shown
        layout = self.glw.ci.layout
        for p in self.plots.values():
            layout.removeItem(p)
        for row, name in enumerate(shown):
            layout.addItem(self.plots[name], row, 0)
        for name, p in self.plots.items():
            p.setVisible(name in shown)
            p.showAxis("bottom", name == shown[-1])
        self.batch_view.setVisible("tokens" in shown)
        self.transfer_view.setVisible("transfers" in shown)
        for name, action in self.plot_actions.items():
            action.setChecked(name in shown)
            action.setEnabled(name != "time" and name not in self._required)
            action.setVisible(self._offered(name))
        self._update_titles()
        self._legend_changed()

    def _offered(self, name: str) -> bool:
        """The plot has something to show for the run: the groups plot with several KV-cache
        groups, the transfers plot with a host tier, the others always."""
        return {"groups": self.num_groups > 1, "transfers": self.has_host_tier}.get(name, True)

    def use_settings(self, settings) -> None:
        """Show the plots last chosen (DEFAULT_PLOTS the first time) and keep each choice."""
        saved = settings.value(PLOTS_KEY, list(DEFAULT_PLOTS))
        saved = [saved] if isinstance(saved, str) else list(saved or ())
        self._settings = None
        self.show_plots([n for n in saved if n in PLOTS])
        self._settings = settings

    def _init_plots_menu(self, menu) -> None:
        """A checkable entry per plot, in `menu` (the time plot's is always on)."""
        for name in PLOTS:
            action = QAction(PLOT_NAMES[name], self, checkable=True, checked=True)
            action.setEnabled(name != "time")
            action.toggled.connect(lambda on, n=name: self._toggle_plot(n, on))
            menu.addAction(action)
            self.plot_actions[name] = action

    def _toggle_plot(self, name: str, on: bool) -> None:
        if on != (name in self.shown_plots):
            self.show_plots([n for n in self._chosen if n != name] + ([name] if on else []))

    def _update_titles(self) -> None:
        """Short plots have no room for their rotated titles (they would overlap): hidden
        then, where the legend line names the curves."""
        if "transfer" not in self.series:  # still being built (its last series)
            return
        tall = self._tall()
        for p in self.plots.values():
            p.getAxis("left").showLabel(self._title_fits(p))
        self.x_axis.showLabel(tall)  # the ticks say "s" on the wall-clock axis
        self.plots["tokens"].getAxis("right").showLabel(tall and self.series["batch"].visible)
        self.plots["transfers"].getAxis("right").showLabel(tall)
        hit_ticks = (0, 50, 100) if tall else (0, 100)  # three labels would overlap
        self.plots["hit"].getAxis("left").setTicks([[(v, str(v)) for v in hit_ticks]])

    def set_axis_label(self, plot: str, text: str | None = None) -> None:
        """The plot's y title (None: its own)."""
        axis = self.plots[plot].getAxis("left")
        axis.setLabel(self._default_titles[plot] if text is None else text)
        axis.showLabel(self._title_fits(self.plots[plot]))  # setLabel shows it

    def set_plot_tip(self, plot: str, text: str | None = None) -> None:
        """The plot's tooltip, what its lines are (None: its own)."""
        self.plots[plot].setToolTip(self._default_tips[plot] if text is None else text)

    def _fit_tokens_axis(self) -> None:
        """The tokens plot from 0 (a steady 1,024 tokens is not "1023.5 to 1024.5") to the top
        of what it shows: the tokens in view, and the series of other owners shown on it (an
        attached server's stored and removed blocks), never clipped."""
        tops = [self._tokens_shown if self.series["tokens"].visible else 0.0]
        tops += [float(s.values.max()) for s in self.series.values()
                 if s.plot == "tokens" and not s.own and s.visible and len(s.values)]
        top = max(1.0, *tops)
        if top != self._tokens_top:
            self._tokens_top = top
            self.plots["tokens"].setYRange(0, top, padding=0.05)

    def show_batch_axis(self, shown: bool) -> None:
        """The tokens plot's right axis, the batch size's scale (hidden where there are no
        batches, e.g. an attached server); the batch series goes with it."""
        axis = self.plots["tokens"].getAxis("right")
        axis.setStyle(showValues=shown)
        axis.setLabel(BATCH_LABEL if shown else "")
        axis.showLabel(shown and self._tall())
        self.show_series("batch", shown)

    # ------------------------------------------------------------------ series
    def _own_series(self, name: str, plot: pg.PlotItem | pg.ViewBox, color: str, label: str,
                    fill: bool = False, legend_order: int | None = None,
                    on: str | None = None) -> pg.PlotDataItem:
        """A series drawn from the records (see Timeline._redraw); filled: with its bars; `on`:
        the plot a right axis's view belongs to (the batch size's: "batch")."""
        curve = pg.PlotDataItem(pen=pg.mkPen(color), fillLevel=0 if fill else None,
                                brush=pg.mkBrush(color) if fill else None, name=label)
        plot.addItem(curve)
        items = [curve]
        if fill:  # zoomed out, drawn as a bar per pixel instead (see timeline_envelope._bars)
            bars = pg.PlotCurveItem(pen=pg.mkPen(color), connect="pairs", antialias=False)
            plot.addItem(bars)
            items.append(bars)
        self._register(name, Series(on or self._plot_name(plot), pg.mkColor(color).name(),
                                    label, label, False, items, own=True), legend_order)
        return curve

    def _plot_name(self, plot) -> str:
        return next((n for n, p in self.plots.items() if p is plot), "batch")

    def _register(self, name: str, series: Series, order: int | None = None) -> None:
        if name in self.series:
            raise ValueError(f"the timeline already has a series {name!r}")
        entries = list(self.series.items())
        entries.insert(len(entries) if order is None else order, (name, series))
        self.series = dict(entries)

    def add_series(self, name: str, plot: str, color: str, label: str, dashed: bool = False,
                   visible: bool = True) -> None:
        """A line of its own on a plot ("time", "tokens", "blocks", "hit"), in the legend as
        `label` (a dashed line drawn and listed dashed) while it is shown and has data. Its
        data: set_series(name, steps, values)."""
        if plot not in self.plots:
            raise ValueError(f"no plot {plot!r}: one of {', '.join(self.plots)}")
        style = Qt.PenStyle.DashLine if dashed else Qt.PenStyle.SolidLine
        item = pg.PlotDataItem(pen=pg.mkPen(color, width=1, style=style))
        item.setVisible(visible)
        self.plots[plot].addItem(item)
        self._register(name, Series(plot, pg.mkColor(color).name(), label, label, dashed,
                                    [item], own=False, visible=visible))
        self._legend_changed()

    def set_series(self, name: str, steps, values) -> None:
        """The series' values at these steps (placed at the steps' x: steps or seconds)."""
        s = self.series[name]
        listed = s.in_legend
        self._set(s, steps, values)
        if s.in_legend != listed:
            self._legend_changed()
        if s.plot == "tokens":
            self._fit_tokens_axis()

    def _set(self, s: Series, steps, values) -> None:
        s.steps = np.asarray(steps, dtype=np.float64)
        s.values = np.asarray(values, dtype=np.float64)
        self._place(s)

    def series_data(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """A series' steps and values, as set (not the timeline's own: see `data`)."""
        s = self.series[name]
        return s.steps, s.values

    def show_series(self, name: str, visible: bool = True) -> None:
        s = self.series[name]
        s.visible = visible
        for item in s.items:
            item.setVisible(visible)
        self._legend_changed()
        if s.plot == "tokens":
            self._fit_tokens_axis()

    def set_series_label(self, name: str, label: str | None = None) -> None:
        """What the legend calls the series (None: its own label)."""
        s = self.series[name]
        s.label = s.default_label if label is None else label
        self._legend_changed()

    def clear_series(self) -> None:
        """Every series given data by its owner, emptied (a new run)."""
        for s in self.series.values():
            if not s.own:
                self._set(s, [], [])
        self._legend_changed()

    def _place(self, s: Series) -> None:
        s.items[0].setData(self.step_x(s.steps), s.values)

    def _place_series(self) -> None:
        """Every series given data, put at its steps' x again (the x axis changed)."""
        for s in self.series.values():
            if not s.own and len(s.steps):
                self._place(s)

    # ------------------------------------------------------------------ legend
    @property
    def legend(self) -> str:
        """Every line shown and every marker, in one line above the plots (a legend inside a
        plot covers its curves)."""
        items = [f"<span style='color:{s.color}'>{'┅' if s.dashed else '━'}</span>&nbsp;{s.label}"
                 for s in self.series.values() if s.in_legend and s.on(self.shown_plots)]
        items += [f"<span style='color:{color}'>{GLYPHS[symbol]}</span>&nbsp;{label}"
                  for symbol, color, label in MARKERS.values()]
        return "&nbsp;&nbsp; ".join(items)

    def _legend_changed(self) -> None:
        self.legend_line.setText(self.legend)
