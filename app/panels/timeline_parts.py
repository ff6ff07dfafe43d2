"""Pieces of the timeline that help reading it: integer step ticks (or seconds), event markers
on the time plot, the readout of every curve's value at the step under the mouse, and a range's
numbers."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg

from kvscope.app import palette
from kvscope.engine import events as ev

# kind -> (symbol, colour, what the legend says)
MARKERS = {ev.EVICTED: ("t", palette.EVICTED_COLOR, "eviction"),
           ev.PREEMPTED: ("d", palette.ACTIVE_COLOR, "preemption"),
           ev.REJECTED: ("x", "#000000", "rejection"),
           ev.CANCELLED: ("s", "#777777", "cancellation")}


class StepAxis(pg.AxisItem):
    """Ticks on whole steps only (a step 12.5 does not exist); with `seconds`, plain ticks in
    seconds (the wall-clock axis)."""

    seconds = False

    def tickSpacing(self, minVal, maxVal, size):  # noqa: N802, N803 - pyqtgraph API
        levels = super().tickSpacing(minVal, maxVal, size)
        if self.seconds:
            return levels
        levels = [(max(1.0, float(np.ceil(s))), o) for s, o in levels]
        return levels or [(1.0, 0.0)]

    def tickStrings(self, values, scale, spacing):  # noqa: N802 - pyqtgraph API
        if self.seconds:  # the unit on every tick: the axis title is hidden in a short dock
            return [f"{text} s" for text in super().tickStrings(values, scale, spacing)]
        return [str(int(round(v))) for v in values]


class SpacedAxis(pg.AxisItem):
    """A value axis whose labels never crowd: tick levels closer than MIN_PX are dropped, and
    the major spacing grows (1, 2, 5, 10, ...) until its labels are MIN_PX apart, though never
    past two labels in view, so a short plot shows two or three round values rather than
    overlapping ones."""

    MIN_PX = 16  # a line of tick text and a little air

    def tickSpacing(self, minVal, maxVal, size):  # noqa: N802, N803 - pyqtgraph API
        levels = super().tickSpacing(minVal, maxVal, size)
        if not levels or maxVal <= minVal or size <= 0:
            return levels
        px = size / (maxVal - minVal)  # pixels per unit
        kept = [(s, o) for s, o in levels if s * px >= self.MIN_PX]
        if kept:
            return kept
        spacing = levels[0][0]
        while spacing * px < self.MIN_PX:
            power = 10 ** np.floor(np.log10(spacing))
            wider = power * {1: 2, 2: 5}.get(round(spacing / power), 10)
            if np.floor(maxVal / wider) - np.ceil(minVal / wider) < 1:
                break  # fewer than two labels: keep these
            spacing = wider
        return [(spacing, 0.0)]

    def tickValues(self, minVal, maxVal, size):  # noqa: N802, N803 - pyqtgraph API
        levels = super().tickValues(minVal, maxVal, size)
        if size < 2 * self.MIN_PX and levels and len(levels[0][1]) > 1:
            spacing, values = levels[0]  # no room for two: the top one gives the scale
            return [(spacing, [max(values)])]
        return levels


class EventMarkers:
    """One scatter item per kind of event, at the bottom of a plot, one marker per step that
    had such an event (the count in the readout), at `to_x(steps)` on the plot's x."""

    def __init__(self, plot: pg.PlotItem):
        self.to_x = lambda steps: steps
        self.steps: dict[str, list[int]] = {kind: [] for kind in MARKERS}
        self.items = {}
        for kind, (symbol, color, label) in MARKERS.items():
            item = pg.ScatterPlotItem(symbol=symbol, size=9, pen=pg.mkPen(color),
                                      brush=pg.mkBrush(color), name=label)
            item.setZValue(5)
            plot.addItem(item)
            self.items[kind] = item

    def add(self, events: list[ev.Event]) -> None:
        changed = set()
        for e in events:
            steps = self.steps.get(e.kind)
            if steps is not None and (not steps or steps[-1] != e.step):
                steps.append(e.step)
                changed.add(e.kind)
        self.place(changed)

    def place(self, kinds=MARKERS) -> None:
        """Put the markers of these kinds where their steps are on x (again)."""
        for kind in kinds:
            xs = self.to_x(np.asarray(self.steps[kind], dtype=np.float64))
            self.items[kind].setData(x=xs, y=np.zeros(len(xs)))

    def clear(self) -> None:
        for kind, item in self.items.items():
            self.steps[kind] = []
            item.setData([], [])

    def at(self, step: int) -> list[str]:
        return [MARKERS[k][2] for k, steps in self.steps.items() if step in steps]


def readout(data: dict[str, np.ndarray], i: int, events: list[str]) -> str:
    """Every curve's value at sample i, in one line."""
    q = data["query_tokens"][i]
    hit = f"{100 * data['hit_tokens'][i] / q:.0f} %" if q else "–"
    at = data["start_s"][i] - data["start_s"][0]
    text = (f"step {int(data['step'][i])} (at {at:.3f} s): prefill "
            f"{data['prefill_ms'][i]:.1f} ms · decode {data['decode_ms'][i]:.1f} ms · tokens "
            f"{int(data['prefill_tokens'][i] + data['decode_tokens'][i])} · batch "
            f"{int(data['batch'][i])} · blocks {int(data['active'][i])} active / "
            f"{int(data['cached'][i])} cached / {int(data['free'][i])} free · hit {hit}")
    return text + "".join(f" · {e}" for e in events)


def range_stats(data: dict[str, np.ndarray], a: int, b: int, evictions: list[int]) -> str:
    """The numbers of samples a..b-1: steps, wall time, tokens, mean and p95 step time, token
    hit rate, evictions."""
    steps = data["step"]
    if b <= a:
        return "no steps in the range"
    ms = data["prefill_ms"][a:b] + data["decode_ms"][a:b]
    wall = data["start_s"][b - 1] + data["wall_s"][b - 1] - data["start_s"][a]
    hit = data["hit_tokens"][b - 1] - (data["hit_tokens"][a - 1] if a else 0)
    query = data["query_tokens"][b - 1] - (data["query_tokens"][a - 1] if a else 0)
    tokens = int((data["prefill_tokens"][a:b] + data["decode_tokens"][a:b]).sum())
    evicted = sum(1 for s in evictions if steps[a] <= s <= steps[b - 1])
    hit_text = f"{100 * hit / query:.0f} %" if query else "–"
    return (f"steps {int(steps[a])}–{int(steps[b - 1])} ({b - a}) · {wall:.2f} s · {tokens} "
            f"tokens · step time mean {ms.mean():.1f} ms, p95 {np.percentile(ms, 95):.1f} ms · "
            f"hit {hit_text} · {evicted} steps with evictions")
