"""The replay bar on a real recorded session: the scrubber takes the bar's width; Home/End, the
step field, the previous/next eviction and the speed move or pace the time cursor, and every
panel follows it."""

from __future__ import annotations

from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from window_testutil import open_replay

from kvscope.app.window.replay_bar import SPEEDS

SESSION = Path(__file__).resolve().parents[1] / "data" / "session_before_step_stream.kvscope"
EVICTION_STEPS = [14, 15, 18, 25, 28, 34, 36, 39]  # read from the file with SessionReader


@pytest.fixture
def replay(qtbot, tmp_path):
    w = open_replay(qtbot, tmp_path, SESSION, (1280, 720))
    qtbot.waitUntil(w.replay_bar.isVisible)
    yield w
    w.close()


def shown_step(w) -> int:
    return w.snapshot.step


def test_the_scrubber_takes_most_of_the_bar(replay):
    bar = replay.replay_bar
    assert bar.slider.width() >= 0.7 * bar.width(), (bar.slider.width(), bar.width())


def test_home_end_and_the_step_field_move_every_panel(replay, qtbot):
    bar = replay.replay_bar
    qtbot.mouseClick(bar.last_button, Qt.LeftButton)
    assert bar.step == 47 and shown_step(replay) == 47 and bar.step_field.value() == 47
    qtbot.mouseClick(bar.first_button, Qt.LeftButton)
    assert bar.step == 0 and shown_step(replay) == 0
    replay.setFocus()
    qtbot.keyClick(replay, Qt.Key_End)
    assert shown_step(replay) == 47
    qtbot.keyClick(replay, Qt.Key_Home)
    assert shown_step(replay) == 0
    bar.step_field.lineEdit().selectAll()
    qtbot.keyClicks(bar.step_field.lineEdit(), "21")
    qtbot.keyClick(bar.step_field.lineEdit(), Qt.Key_Return)
    assert bar.step == 21 and shown_step(replay) == 21
    assert replay.timeline.cursors[0].value() == 21


def test_previous_and_next_eviction(replay, qtbot):
    bar = replay.replay_bar
    bar.jump_kind.setCurrentText("eviction")
    bar.set_step(20)
    qtbot.mouseClick(bar.jump_button, Qt.LeftButton)
    assert shown_step(replay) == 25
    qtbot.mouseClick(bar.jump_prev_button, Qt.LeftButton)
    assert shown_step(replay) == 18
    qtbot.mouseClick(bar.jump_prev_button, Qt.LeftButton)
    qtbot.mouseClick(bar.jump_prev_button, Qt.LeftButton)
    assert shown_step(replay) == 14
    qtbot.mouseClick(bar.jump_prev_button, Qt.LeftButton)  # none earlier: stays, and says so
    assert shown_step(replay) == 14 and bar.label.text() == "no earlier eviction"
    assert any(e.kind == "evicted" for e in replay.events.events if e.step == 14)


def test_play_speed_paces_the_steps(replay, qtbot):
    bar = replay.replay_bar
    bar.speed.setCurrentText("8×")
    assert bar.timer.interval() == 1000 // SPEEDS["8×"]
    qtbot.mouseClick(bar.play_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: shown_step(replay) >= 4, timeout=3000)
    qtbot.mouseClick(bar.play_button, Qt.LeftButton)
    stopped = shown_step(replay)
    qtbot.wait(300)
    assert shown_step(replay) == stopped
