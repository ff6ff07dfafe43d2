"""Reading the timeline: it follows the newest step until the user pans (then Follow, F or a
double-click bring it back), the mouse shows every value at its step, batch size has its own
axis, step ticks are whole, and events are marked on the time plot."""

from __future__ import annotations

import numpy as np
import pytest
from PySide6.QtCore import QPoint, QPointF, Qt
from test_panel_screenshots import scenario
from test_timeline import records
from window_testutil import beside_a_label

from kvscope.app.frames import Frame
from kvscope.app.panels.timeline import HOVER_HINT, Timeline
from kvscope.engine import events as ev


@pytest.fixture
def timeline(qtbot):
    t = Timeline()
    box, other = beside_a_label(qtbot, t, (1000, 420))
    t.show_frame(Frame(records=records(100)))
    qtbot.waitUntil(lambda: t._pending == 0)
    t.other = other
    yield t
    box.close()


def x_range(t):
    return t.time_plot.vb.viewRange()[0]


def at_step(t, plot, step: float, y_frac: float = 0.5) -> QPoint:
    (_, _), (y0, y1) = plot.vb.viewRange()
    scene = plot.vb.mapViewToScene(QPointF(step, y0 + (y1 - y0) * y_frac))
    return t.glw.mapFromScene(scene)


def add(t, qtbot, start: int, n: int) -> None:
    t.show_frame(Frame(records=records(n, start)))
    qtbot.waitUntil(lambda: t._pending == 0)


def test_it_follows_until_panned_then_follow_f_and_double_click_fit(timeline, qtbot):
    t = timeline
    add(t, qtbot, 100, 100)
    qtbot.waitUntil(lambda: x_range(t)[1] >= 199)
    assert t.following and not t.follow_button.isVisible()
    # A drag on the plot pans it: the view stays where the user put it.
    vp = t.glw.viewport()
    qtbot.mousePress(vp, Qt.LeftButton, pos=at_step(t, t.block_plot, 100))
    for s in (110, 130, 150):
        qtbot.mouseMove(vp, at_step(t, t.block_plot, s))
    qtbot.mouseRelease(vp, Qt.LeftButton, pos=at_step(t, t.block_plot, 150))
    qtbot.waitUntil(lambda: not t.following)
    assert t.follow_button.isVisible()
    shown = x_range(t)
    add(t, qtbot, 200, 100)
    qtbot.wait(100)
    assert x_range(t) == shown  # not dragged along to step 299
    qtbot.mouseClick(t.follow_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: x_range(t)[1] >= 299)
    assert t.following and not t.follow_button.isVisible()
    t.time_plot.setXRange(10, 40)  # a zoom, as the wheel does it
    assert not t.following
    t.setFocus()
    qtbot.keyClick(t, Qt.Key_F)
    assert t.following
    t.time_plot.setXRange(10, 40)
    qtbot.mouseDClick(vp, Qt.LeftButton, pos=at_step(t, t.block_plot, 20))
    assert t.following
    qtbot.mouseRelease(vp, Qt.LeftButton, pos=at_step(t, t.block_plot, 20))  # QTest's state


def test_hover_shows_every_value_at_the_step_beside_the_legend(timeline, qtbot):
    t = timeline
    r = records(100)[42]
    legend = t.legend_line.text()
    qtbot.mouseMove(t.glw.viewport(), at_step(t, t.token_plot, 42.2))
    qtbot.waitUntil(lambda: t.readout.text().startswith("step 42 "))
    text = t.readout.text()
    assert f"decode {r.decode_s * 1e3:.1f} ms" in text
    assert f"tokens {r.prefill_tokens + r.decode_tokens}" in text
    assert f"batch {r.batch_size}" in text
    assert (f"blocks {r.num_active_blocks} active / {r.num_cached_blocks} cached / "
            f"{r.num_free_blocks} free") in text
    assert all(line.isVisible() and line.value() == 42 for line in t.hover_lines)
    assert t.legend_line.text() == legend == t.legend  # hovering keeps the legend in sight
    assert text.startswith("step 42 (at ") and "s): prefill" in text
    qtbot.mouseMove(t.other, QPoint(3, 3))
    qtbot.waitUntil(lambda: t.readout.text() == HOVER_HINT)  # how to read it, again
    assert not any(line.isVisible() for line in t.hover_lines)


def test_batch_size_has_its_own_axis(timeline):
    t = timeline
    batch_top = t.batch_view.viewRange()[1][1]
    token_top = t.token_plot.vb.viewRange()[1][1]
    # records(): batch 64 every step, tokens 64 or 576: each scale fits its own curve.
    assert 64 <= batch_top < 100 and token_top >= 576
    assert t.token_plot.getAxis("right").labelText == "batch"


def test_step_ticks_are_whole_steps(timeline):
    axis = timeline.hit_plot.getAxis("bottom")
    for lo, hi in ((10, 14), (0, 3), (0, 99)):
        for _, values in axis.tickValues(lo, hi, 900):
            assert all(float(v).is_integer() for v in values), (lo, hi, values)
    assert axis.tickStrings([3.0, 4.0], 1, 1) == ["3", "4"]


def test_events_are_marked_on_the_time_plot(timeline, qtbot):
    t = timeline
    events = scenario().events.drain()  # a real manager's: evictions at step 2
    evicted_steps = sorted({e.step for e in events if e.kind == ev.EVICTED})
    assert evicted_steps
    t.show_frame(Frame(events=events))
    xs, _ = t.markers.items[ev.EVICTED].getData()
    assert sorted(np.asarray(xs).tolist()) == evicted_steps
    assert len(t.markers.items[ev.REJECTED].getData()[0]) == 0  # none in the scenario
    qtbot.mouseMove(t.glw.viewport(), at_step(t, t.time_plot, evicted_steps[0]))
    qtbot.waitUntil(lambda: t.readout.text().endswith("· eviction"))
    t.clear()
    assert len(t.markers.items[ev.EVICTED].getData()[0]) == 0


def test_the_legend_names_every_curve_in_its_colour_and_every_marker(timeline):
    t = timeline
    text = t.legend_line.text()
    for curve in (t.prefill_curve, t.total_curve, t.tokens_curve, t.batch_curve,
                  t.active_curve, t.cached_curve, t.free_curve, t.hit_curve):
        assert f"color:{curve.opts['pen'].color().name()}" in text
    for label in ("prefill ms", "decode ms", "batch (right axis)", "hit %", "eviction",
                  "preemption", "rejection", "cancellation"):
        assert label in text


def test_shift_drag_selects_a_range_and_shows_its_numbers(timeline, qtbot):
    t = timeline
    vp = t.glw.viewport()
    qtbot.mousePress(vp, Qt.LeftButton, Qt.ShiftModifier, at_step(t, t.block_plot, 10))
    qtbot.mouseMove(vp, at_step(t, t.block_plot, 15))
    qtbot.mouseRelease(vp, Qt.LeftButton, Qt.ShiftModifier, at_step(t, t.block_plot, 19.3))
    assert t.following  # a shift-drag does not pan
    lo, hi = t.region.getRegion()
    assert 9.5 < lo < 10.5 and 19 < hi < 19.5  # the steps under both ends, and those between
    rs = records(100)[10:20]
    ms = np.array([(r.prefill_s + r.decode_s) * 1e3 for r in rs])
    tokens = sum(r.prefill_tokens + r.decode_tokens for r in rs)
    wall = rs[-1].start_s + rs[-1].wall_s - rs[0].start_s
    hit = 100 * sum(r.hit_tokens for r in rs) / sum(r.query_tokens for r in rs)
    text = t.range_label.text()
    assert text.startswith("steps 10–19 (10) · ") and f"{wall:.2f} s" in text
    assert f"{tokens} tokens" in text and f"mean {ms.mean():.1f} ms" in text
    assert f"p95 {np.percentile(ms, 95):.1f} ms" in text and f"hit {hit:.0f} %" in text
    t.clear()
    assert not t.range_label.isVisible()
