"""The timeline's wall-clock x axis (seconds since the first step, T): ticks in seconds, and a
click, the hover readout, a range, the cursor and the markers all land on the step that ran at
that time; the curves are reduced by pixel column, not by runs of steps."""

from __future__ import annotations

import numpy as np
import pytest
from PySide6.QtCore import QPoint, QPointF, Qt
from PySide6.QtWidgets import QVBoxLayout, QWidget

from kvscope.app.frames import Frame
from kvscope.app.panels.timeline import SECONDS_LABEL, STEP_LABEL, Timeline, _bars, _peaks
from kvscope.engine import events as ev
from kvscope.engine.metrics import StepRecord

LONG = 50  # the one long step: 1.5 s where the others take 20 ms


def records() -> list[StepRecord]:
    out, t = [], 100.0  # monotonic seconds: the axis counts from the first step
    for s in range(100):
        wall = 1.5 if s == LONG else 0.02
        out.append(StepRecord(step=s, start_s=t, wall_s=wall, decode_s=wall * 0.9,
                              decode_tokens=8, batch_size=8, num_active_blocks=10 + s,
                              num_free_blocks=200 - s))
        t += wall + 0.001
    return out


RECS = records()
START = {r.step: r.start_s - RECS[0].start_s for r in RECS}  # x of each step, in seconds


@pytest.fixture
def timeline(qtbot):
    box = QWidget()
    t = Timeline()
    QVBoxLayout(box).addWidget(t)
    qtbot.addWidget(box)
    box.resize(1000, 420)
    box.show()
    qtbot.waitExposed(box)
    t.show_frame(Frame(records=RECS, events=[ev.Event(ev.EVICTED, LONG, 1, (3,), 0)]))
    qtbot.waitUntil(lambda: t._pending == 0)
    yield t
    box.close()


def at_x(t, x: float) -> QPoint:
    vb = t.block_plot.vb
    (_, _), (y0, y1) = vb.viewRange()
    return t.glw.mapFromScene(vb.mapViewToScene(QPointF(x, (y0 + y1) / 2)))


def shown_ticks(t) -> list[str]:
    """The bottom axis' tick labels for the range shown, as the axis draws them."""
    axis = t.x_axis
    (x0, x1), _ = t.time_plot.vb.viewRange()
    out = []
    for spacing, values in axis.tickValues(x0, x1, axis.width()):
        out += axis.tickStrings(values, axis.scale, spacing)
    return out


def test_t_switches_the_axis_to_seconds_and_back(timeline, qtbot):
    t = timeline
    assert max(float(v) for v in shown_ticks(t)) >= 80  # steps 0..99
    t.setFocus()
    qtbot.keyClick(t, Qt.Key_T)
    assert t.wall_clock and t.act_wall_clock.isChecked()
    qtbot.waitUntil(lambda: t.time_plot.vb.viewRange()[0][1] < 10)
    ticks = [float(v.removesuffix(" s")) for v in shown_ticks(t)]
    total = START[99]  # about 3.5 s
    assert ticks and max(ticks) <= total + 0.5 and {1.0, 2.0, 3.0} <= set(ticks)
    assert t.x_axis.labelText == SECONDS_LABEL
    x, _ = t.tokens_curve.getData()
    assert x[0] == 0 and x[-1] == pytest.approx(total + RECS[99].wall_s)  # where it ended
    # Each step is drawn over the time it ran: the long step's forward time is a box 1.5 s
    # wide, not a line from its start to the next step's.
    x, y = t.total_curve.getData()
    top = RECS[LONG].decode_s * 1e3
    at_top = sorted(v for v, h in zip(x, y, strict=True) if h == pytest.approx(top))
    assert at_top == [pytest.approx(START[LONG]), pytest.approx(START[LONG] + 1.5)]
    qtbot.keyClick(t, Qt.Key_T)
    assert not t.wall_clock and t.x_axis.labelText == STEP_LABEL
    qtbot.waitUntil(lambda: t.time_plot.vb.viewRange()[0][1] >= 99)
    assert t.tokens_curve.getData()[0][-1] == 99


def test_a_click_at_a_time_selects_the_step_running_then(timeline, qtbot):
    t = timeline
    t.set_wall_clock(True)
    qtbot.waitUntil(lambda: t.time_plot.vb.viewRange()[0][1] < 10)
    vp = t.glw.viewport()
    # 1.2 s into the long step: by step number that x would be step 1 or 2.
    for x, step in ((START[LONG] + 1.2, LONG), (START[20] + 0.005, 20), (START[80], 80)):
        with qtbot.waitSignal(t.step_clicked) as got:
            qtbot.mouseClick(vp, Qt.LeftButton, pos=at_x(t, x))
        assert got.args == [step], x
        qtbot.wait(20)  # pyqtgraph drops moves within 10 ms of the last (mouseRateLimit)
        qtbot.mouseMove(vp, at_x(t, x) + QPoint(0, 3))
        qtbot.waitUntil(lambda s=step: t.readout.text().startswith(f"step {s} "))
    assert f"(at {START[80]:.3f} s)" in t.readout.text()


def test_cursor_markers_and_range_follow_the_steps_on_either_axis(timeline, qtbot):
    t = timeline
    t.selection.select_step(60)
    assert all(line.value() == 60 for line in t.cursors)
    vp = t.glw.viewport()
    qtbot.mousePress(vp, Qt.LeftButton, Qt.ShiftModifier, at_x(t, 10))
    qtbot.mouseRelease(vp, Qt.LeftButton, Qt.ShiftModifier, at_x(t, 19.3))
    assert t.range_steps == (10, 19)
    t.set_wall_clock(True)
    assert all(line.value() == pytest.approx(START[60]) for line in t.cursors)
    assert t.markers.items[ev.EVICTED].getData()[0].tolist() == [pytest.approx(START[LONG])]
    assert t.range_steps == (10, 19) and t.range_label.text().startswith("steps 10–19 (10)")
    assert t.region.getRegion() == (pytest.approx(START[10]), pytest.approx(START[19]))
    # A drag inside the long step, in seconds: the step running at both ends.
    qtbot.waitUntil(lambda: t.time_plot.vb.viewRange()[0][1] < 10)
    qtbot.mousePress(vp, Qt.LeftButton, Qt.ShiftModifier, at_x(t, START[LONG] + 0.01))
    qtbot.mouseRelease(vp, Qt.LeftButton, Qt.ShiftModifier, at_x(t, START[LONG] + 1.4))
    assert t.range_steps == (LONG, LONG) and "(1) · 1.50 s" in t.range_label.text()
    t.selection.select_step(70)  # the replay scrubber and ← → move the cursor by step
    assert all(line.value() == pytest.approx(START[70]) for line in t.cursors)
    t.set_wall_clock(False)
    assert all(line.value() == 70 for line in t.cursors) and t.range_steps == (LONG, LONG)
    assert t.markers.items[ev.EVICTED].getData()[0].tolist() == [LONG]


def test_zoomed_in_the_same_steps_stay_in_view_when_switching(timeline, qtbot):
    t = timeline
    t.time_plot.setXRange(40, 60, padding=0)
    t.set_wall_clock(True)
    (x0, x1), _ = t.time_plot.vb.viewRange()
    assert (x0, x1) == (pytest.approx(START[40]), pytest.approx(START[60]))
    assert not t.following


def test_pixel_columns_keep_the_envelope_without_borrowing_far_neighbours():
    rng = np.random.default_rng(0)
    gaps = np.where(rng.random(3000) < 0.01, 5.0, 0.01)  # a few long pauses between steps
    x = np.concatenate([[0.0], np.cumsum(gaps)])
    y = rng.normal(size=len(x))
    width = 300
    px, py = _peaks(x, y, 0, width)
    assert py.max() == y.max() and py.min() == y.min() and px[-1] == x[-1] and py[-1] == y[-1]
    edges = np.linspace(x[0], x[-1], width + 1)
    # Each column's max and min are those of the line drawn through every sample in it.
    for k in range(0, len(px) - 1, 2):
        j = min(int(np.searchsorted(edges, px[k], side="right")) - 1, width - 1)
        dense = np.linspace(edges[j], edges[j + 1], 400)
        inside = x[(x >= edges[j]) & (x < edges[j + 1])]
        line = np.interp(np.concatenate([dense, inside]), x, y)
        assert py[k] == pytest.approx(line.max()) and py[k + 1] == pytest.approx(line.min())
    bx, by = _bars(x, y, 0, width)
    assert by[1::2].max() == y.max() and (by[::2] == 0).all() and bx[-1] == x[-1]


def test_a_right_click_opens_the_menu_and_a_right_drag_still_zooms(timeline, qtbot):
    t = timeline
    vp = t.glw.viewport()
    shown = t.time_plot.vb.viewRange()[0]
    qtbot.mousePress(vp, Qt.RightButton, pos=at_x(t, 20))
    for x in (30, 40, 60):
        qtbot.wait(15)  # pyqtgraph drops moves within 10 ms of the last
        qtbot.mouseMove(vp, at_x(t, x))
    qtbot.mouseRelease(vp, Qt.RightButton, pos=at_x(t, 60))
    qtbot.waitUntil(lambda: t.time_plot.vb.viewRange()[0] != shown)
    assert not t.menu.isVisible() and not t.following
    qtbot.mouseClick(vp, Qt.RightButton, pos=at_x(t, 50))
    qtbot.waitUntil(t.menu.isVisible)
    assert not t.act_export_range.isEnabled()  # no range yet
    assert t.act_wall_clock in t.menu.actions()
    t.menu.hide()
