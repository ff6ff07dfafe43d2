"""Export a range of steps from the timeline, in replay and live: shift-drag a range, press
"Export range…" (or the plots' right-click menu), pick a file (the dialog is a seam here) and the
file holds exactly those steps; never over the open session, never over a file without asking.
The wall-clock axis from the window: the View menu's action, and the replay scrubber still moves
the cursor by step."""

from __future__ import annotations

import csv
import json

import pytest
from PySide6.QtCore import QPointF, Qt
from test_timeline_wall_clock import at_x
from window_testutil import open_replay, open_window, step

from kvscope.engine.config import SamplingParams
from kvscope.sessions import SessionReader
from kvscope.sessions.export import range_exporters

PARAMS = SamplingParams(max_tokens=30, ignore_eos=True)


@pytest.fixture
def replay(qtbot, tmp_path, session):
    w = open_replay(qtbot, tmp_path, session)
    yield w
    w.close()


def drag_range(t, qtbot, a: float, b: float) -> None:
    vp = t.glw.viewport()
    qtbot.mousePress(vp, Qt.LeftButton, Qt.ShiftModifier, at_x(t, a))
    qtbot.mouseMove(vp, at_x(t, (a + b) / 2))
    qtbot.mouseRelease(vp, Qt.LeftButton, Qt.ShiftModifier, at_x(t, b))


TRACE_FILTER, CSV_FILTER = (x.range_filter for x in range_exporters())


class Dialogs:
    """The file dialog and the replace question, answered by the test."""

    def __init__(self, window, path, chosen=TRACE_FILTER, replace=False):
        self.path, self.chosen, self.replace = path, chosen, replace
        self.suggested, self.asked_replace = None, 0
        window.range_export.ask_path = self.ask_path
        window.range_export.confirm_overwrite = self.confirm

    def ask_path(self, title, suggested, filters):
        self.suggested, self.filters = suggested, filters
        return str(self.path), self.chosen

    def confirm(self, path):
        self.asked_replace += 1
        return self.replace


def trace_steps(path) -> list[int]:
    trace = json.loads(path.read_text())
    return [int(e["name"].split()[1]) for e in trace["traceEvents"] if e.get("cat") == "step"]


def csv_steps(path) -> list[int]:
    with open(path, newline="") as f:
        return [int(row["step"]) for row in csv.DictReader(f)]


def test_replay_drag_a_range_then_export_it_as_a_trace_and_as_csv(replay, qtbot, tmp_path,
                                                                  session):
    w, t = replay, replay.timeline
    drag_range(t, qtbot, 10, 19.3)
    assert t.range_steps == (10, 19) and t.export_button.isVisible()
    dialogs = Dialogs(w, tmp_path / "range.json")
    qtbot.mouseClick(t.export_button, Qt.LeftButton)
    assert dialogs.suggested.endswith("run-steps-10-19.json")
    assert trace_steps(tmp_path / "range.json") == list(range(10, 20))
    assert "wrote steps 10–19 (10)" in w.statusBar().currentMessage()

    # The same range from the right-click menu, as CSV (a name without a suffix gets the
    # chosen type's).
    Dialogs(w, tmp_path / "range", chosen=CSV_FILTER)
    vp = t.glw.viewport()
    qtbot.mouseClick(vp, Qt.RightButton, pos=at_x(t, 30))
    qtbot.waitUntil(t.menu.isVisible)
    assert t.act_export_range.isEnabled()
    qtbot.mouseClick(t.menu, Qt.LeftButton,
                     pos=t.menu.actionGeometry(t.act_export_range).center())
    qtbot.waitUntil(lambda: (tmp_path / "range.csv").exists())
    assert csv_steps(tmp_path / "range.csv") == list(range(10, 20))
    with SessionReader(session) as s:
        assert len(csv_steps(tmp_path / "range.csv")) == len(s.steps(10, 19))


def test_export_refuses_the_open_session_and_asks_before_replacing(replay, qtbot, tmp_path,
                                                                  session):
    w, t = replay, replay.timeline
    before = session.read_bytes()
    drag_range(t, qtbot, 3, 8)
    dialogs = Dialogs(w, session, replace=True)
    qtbot.mouseClick(t.export_button, Qt.LeftButton)
    assert w.banner.isVisible() and "refusing to overwrite the input" in w.banner.label.text()
    assert dialogs.asked_replace == 0 and session.read_bytes() == before
    mine = tmp_path / "mine.csv"
    mine.write_text("keep me")
    dialogs = Dialogs(w, mine, chosen=CSV_FILTER, replace=False)
    qtbot.mouseClick(t.export_button, Qt.LeftButton)
    assert dialogs.asked_replace == 1 and mine.read_text() == "keep me"
    dialogs.replace = True
    qtbot.mouseClick(t.export_button, Qt.LeftButton)
    assert csv_steps(mine) == list(range(3, 9))


def test_replay_scrubber_moves_the_cursor_by_step_on_the_wall_clock_axis(replay, qtbot):
    w, t = replay, replay.timeline
    assert t.act_wall_clock in w.view_menu.actions()
    w.activateWindow()
    qtbot.keyClick(w, Qt.Key_T)
    assert t.wall_clock
    w.replay_bar.set_step(25)
    start = {int(s): x for s, x in zip(t.data["step"], t.x, strict=True)}
    assert start[0] == 0 and all(line.value() == pytest.approx(start[25]) for line in t.cursors)
    # Click a step on the seconds axis: the scrubber follows.
    vb = t.block_plot.vb
    middle = start[31] + t.data["wall_s"][31] / 2
    pos = t.glw.mapFromScene(vb.mapViewToScene(QPointF(middle, vb.viewRange()[1][0] + 1)))
    qtbot.mouseClick(t.glw.viewport(), Qt.LeftButton, pos=pos)
    assert w.replay_bar.step == 31 and w.snapshot.step == 31
    t.act_wall_clock.trigger()  # the View menu's entry
    assert not t.wall_clock and all(line.value() == 31 for line in t.cursors)


def test_live_a_range_exports_from_the_engines_history(qtbot, tmp_path):
    w = open_window(qtbot, tmp_path)
    try:
        t = w.timeline
        for i in range(3):
            w.engine_client.submit(f"Live question {i} on sets? " * 3, PARAMS, None)
        step(w, qtbot, 12)
        with SessionReader(w.engine.history_path) as history:  # the engine process writes it
            # (none at first: the recorder commits about every 0.25 s)
            qtbot.waitUntil(lambda: (history.refresh(), history.last_step or -1)[1] >= 11,
                            timeout=5000)
        qtbot.waitUntil(lambda: t.time_plot.vb.viewRange()[0][1] >= 11)  # steps drawn
        drag_range(t, qtbot, 3, 8)
        assert t.range_steps == (3, 8)
        Dialogs(w, tmp_path / "live.json")
        qtbot.mouseClick(t.export_button, Qt.LeftButton)
        assert trace_steps(tmp_path / "live.json") == list(range(3, 9))
        Dialogs(w, w.engine.history_path)  # the live input: refused too
        qtbot.mouseClick(t.export_button, Qt.LeftButton)
        assert "refusing to overwrite the input" in w.banner.label.text()
        # T is the axis' shortcut, yet a "t" typed in the prompt is text.
        w.activateWindow()
        w.composer.prompt.setFocus()
        qtbot.keyClicks(w.composer.prompt, "tt")
        assert w.composer.prompt.toPlainText() == "tt" and not t.wall_clock
        t.setFocus()
        qtbot.keyClick(t, Qt.Key_T)
        assert t.wall_clock
    finally:
        w.close()
