"""Pieces of the timeline that help reading it: integer step ticks, event markers on the time
plot, and the readout of every curve's value at the step under the mouse."""

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
    """Ticks on whole steps only (a step 12.5 does not exist)."""

    def tickSpacing(self, minVal, maxVal, size):  # noqa: N802, N803 - pyqtgraph API
        levels = [(max(1.0, float(np.ceil(s))), o) for s, o in
                  super().tickSpacing(minVal, maxVal, size)]
        return levels or [(1.0, 0.0)]

    def tickStrings(self, values, scale, spacing):  # noqa: N802 - pyqtgraph API
        return [str(int(round(v))) for v in values]


class EventMarkers:
    """One scatter item per kind of event, at the bottom of a plot, one marker per step that
    had such an event (the count in the readout)."""

    def __init__(self, plot: pg.PlotItem):
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
        for kind in changed:
            xs = np.asarray(self.steps[kind], dtype=np.float64)
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
    text = (f"step {int(data['step'][i])} · prefill {data['prefill_ms'][i]:.1f} ms · decode "
            f"{data['decode_ms'][i]:.1f} ms · tokens "
            f"{int(data['prefill_tokens'][i] + data['decode_tokens'][i])} · batch "
            f"{int(data['batch'][i])} · blocks {int(data['active'][i])} active / "
            f"{int(data['cached'][i])} cached / {int(data['free'][i])} free · hit {hit}")
    return text + "".join(f" · {e}" for e in events)
