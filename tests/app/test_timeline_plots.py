"""The timeline in the window at 1280x720 and 1600x1000 (issue 26, item 9): two plots by default,
each tall enough for its y title, the others chosen from View > Timeline plots (kept across
launches); the legend stays while the mouse shows a step's values, in one line that fits; a flat
0 dead-cache line is neither drawn nor listed; a reload starts from an empty x range."""

from __future__ import annotations

import numpy as np
import pytest
from PySide6.QtCore import QPointF, Qt
from window_testutil import bare_window, open_window, step

from kvscope.app.frames import Frame
from kvscope.app.panels.timeline import HOVER_HINT
from kvscope.app.panels.timeline_series import DEFAULT_PLOTS, PLOT_NAMES
from kvscope.engine import SamplingParams

SIZES = [(1280, 720), (1600, 1000)]


def menu_entry(w, text: str):
    """The View menu's entry, as a user finds it (a submenu's entries included)."""
    for action in w.view_menu.actions():
        if action.text() == text:
            return action
        if action.menu() is not None:
            for sub in action.menu().actions():
                if sub.text() == text:
                    return sub
    raise AssertionError(f"no {text!r} in the View menu")


def title_rect(plot):
    """The scene rectangle of a plot's y title (empty when hidden)."""
    label = plot.getAxis("left").label
    return label.mapRectToScene(label.boundingRect()) if label.isVisible() else None


def shown(t):
    return [name for name, p in t.plots.items() if p.isVisible()]


def at_step(t, plot, x: float):
    (_, _), (y0, y1) = plot.vb.viewRange()
    return t.glw.mapFromScene(plot.vb.mapViewToScene(QPointF(x, (y0 + y1) / 2)))


def readout_at(qtbot, w, t, plot, step: int) -> str:
    """The timeline's readout with the mouse on `plot` at `step`, come from outside it (the
    cursor may be where the last test left it)."""
    qtbot.mouseMove(w.statusBar())
    qtbot.mouseMove(t.glw.viewport(), at_step(t, plot, step))
    qtbot.waitUntil(lambda: t.readout.text().startswith(f"step {step} "))
    return t.readout.text()


@pytest.mark.parametrize("size", SIZES, ids=["1280x720", "1600x1000"])
def test_default_plots_show_their_titles_and_the_user_adds_one(qtbot, tmp_path, session, size):
    w = bare_window(qtbot, tmp_path, size)
    assert w.open_session(str(session))
    t = w.timeline
    qtbot.waitUntil(lambda: len(t.data["step"]) > 0)
    qtbot.wait(50)
    assert shown(t) == list(DEFAULT_PLOTS)
    rects = [title_rect(t.plots[n]) for n in DEFAULT_PLOTS]
    assert all(r is not None for r in rects), "every y title shows"
    assert not rects[0].intersects(rects[1])
    for n in DEFAULT_PLOTS:  # within its own plot's height, not cut
        box, title = t.plots[n].sceneBoundingRect(), title_rect(t.plots[n])
        assert box.top() <= title.top() and title.bottom() <= box.bottom(), n
    assert t.x_axis is t.plots["blocks"].getAxis("bottom") and t.x_axis.isVisible()
    assert "hit %" not in t.legend and "cached" in t.legend  # only the lines shown

    # Hover a step on the blocks plot: its values in one line that fits, the legend stays.
    legend = t.legend_line.text()
    qtbot.mouseMove(t.glw.viewport(), at_step(t, t.block_plot, 20))
    qtbot.waitUntil(lambda: t.readout.text().startswith("step 20 (at "))
    text = t.readout.text()
    assert "s): prefill" in text and t.legend_line.text() == legend
    assert t.readout.fontMetrics().horizontalAdvance(text) <= t.readout.width(), text
    qtbot.mouseMove(w.statusBar())
    qtbot.waitUntil(lambda: t.readout.text() == HOVER_HINT)

    # View > Timeline plots > Token hit rate: the plot joins, with its x axis under it.
    menu_entry(w, PLOT_NAMES["hit"]).trigger()
    assert shown(t) == [*DEFAULT_PLOTS, "hit"]
    assert t.x_axis is t.plots["hit"].getAxis("bottom") and t.x_axis.isVisible()
    assert not t.plots["blocks"].getAxis("bottom").isVisible()
    assert "hit %" in t.legend
    menu_entry(w, PLOT_NAMES["blocks"]).trigger()  # and one leaves
    assert shown(t) == ["time", "hit"] and "cached" not in t.legend
    assert not menu_entry(w, PLOT_NAMES["time"]).isEnabled()  # the time plot always shows
    w.close()

    again = bare_window(qtbot, tmp_path, size)  # the same settings file: the choice is kept
    assert shown(again.timeline) == ["time", "hit"]
    assert menu_entry(again, PLOT_NAMES["hit"]).isChecked()
    assert not menu_entry(again, PLOT_NAMES["blocks"]).isChecked()
    again.close()


def test_a_flat_zero_dead_line_is_not_drawn_and_a_reload_empties_the_x_range(qtbot, tmp_path):
    w = open_window(qtbot, tmp_path)
    w.resize(1280, 720)
    t = w.timeline
    for i in range(4):
        w.engine_client.submit(f"Tell me about lists {i} " * 4,
                               SamplingParams(max_tokens=40, ignore_eos=True), None)
    step(w, qtbot, 30)
    qtbot.waitUntil(lambda: t.time_plot.vb.viewRange()[0][1] >= 29)
    # the engine's dead-cache count is 0 all run here: no magenta line at 0, nothing listed
    assert "dead" not in t.legend
    assert len(t.series["dead"].items[0].getData()[0] or []) == 0
    t.show_frame(Frame(dead_counts=(np.array([0, 10]), np.array([0, 2]))))
    assert "dead (unreachable)" in t.legend  # a real count is
    qtbot.keyClick(w, Qt.Key_R, Qt.ControlModifier | Qt.ShiftModifier)  # Apply (reload)
    qtbot.waitUntil(lambda: len(t.data["step"]) == 0, timeout=30_000)
    qtbot.wait(100)
    lo, hi = t.time_plot.vb.viewRange()[0]
    assert hi < 5, (lo, hi)  # not the old run's 30 steps
    assert "dead" not in t.legend
    w.close()
