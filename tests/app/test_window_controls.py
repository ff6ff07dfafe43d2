"""The window's controls do what they say, at 1280x720 and 1600x1000 (issue 26): Run demo plays the
demo again once it finished; in replay the engine's buttons are off and the replay bar takes
their keys."""

from __future__ import annotations

import json

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QToolBar
from window_testutil import LOAD_TIMEOUT_MS, bare_window, open_replay

from kvscope.app.window import engine_controls

SIZES = [(1280, 720), (1600, 1000)]


def loaded(qtbot, w, name: str) -> None:
    qtbot.waitUntil(lambda: w.engine is not None and not w.engine_client.loading
                    and w.model_name == name, timeout=LOAD_TIMEOUT_MS)


@pytest.mark.parametrize("size", SIZES)
def test_run_demo_plays_the_demo_again_once_it_finished(qtbot, tmp_path, size, monkeypatch):
    """F5 after the demo finished did nothing but say "paused", as the status bar did at
    start-up before anything ran."""
    demo = tmp_path / "short_demo.jsonl"
    demo.write_text("".join(json.dumps({"arrival_s": 0, "prompt": f"What is a {thing}?",
                                        "max_tokens": 3}) + "\n" for thing in ("list", "dict")))
    monkeypatch.setattr(engine_controls, "DEMO_WORKLOAD", str(demo))  # an absolute path
    w = bare_window(qtbot, tmp_path, size)
    w.pace_box.setValue(0)
    w.load_model("demo")
    loaded(qtbot, w, "demo")
    qtbot.waitUntil(lambda: "Press Run demo (F5)" in w.status.text())
    assert "paused" not in w.status.text()
    done = "· nothing left to run · F5 runs the demo"
    for runs in (1, 2):
        w.setFocus()
        qtbot.keyClick(w, Qt.Key_F5)
        qtbot.waitUntil(lambda runs=runs: len(rows := w.requests.model.rows) == 2 * runs
                        and all(r.state.startswith("finished") for r in rows)
                        and w.status.text().endswith(done), timeout=20_000)
    w.close()


@pytest.mark.parametrize("size", SIZES)
def test_replay_turns_off_the_engine_buttons_and_its_bar_takes_their_keys(
        qtbot, tmp_path, session, size):
    """In replay the toolbar's Run demo, Pause, Step and Follow live stayed on beside the replay
    bar's own controls."""
    w = open_replay(qtbot, tmp_path, session, size)
    tb, bar, sel = w.findChild(QToolBar, "toolbar_main"), w.replay_bar, w.selection
    engine_buttons = [tb.widgetForAction(a) for a in (w.act_demo, w.act_pause, w.act_step,
                                                      w.act_follow)] + [w.pace_box]
    assert [b.isEnabled() for b in engine_buttons] == [False] * 5
    first, last = bar.slider.minimum(), bar.slider.maximum()
    assert sel.step == first
    w.activateWindow()  # the keys go to the window
    qtbot.waitUntil(w.isActiveWindow)
    for key, step in ((Qt.Key_N, first + 1), (Qt.Key_Right, first + 2), (Qt.Key_Left, first + 1),
                      (Qt.Key_End, last), (Qt.Key_Home, first)):
        qtbot.keyClick(w, key)
        assert sel.step == step and bar.slider.value() == step, key
    qtbot.keyClick(w, Qt.Key_F5)
    assert bar.play_button.isChecked()
    qtbot.waitUntil(lambda: sel.step > first + 1)  # it plays
    qtbot.keyClick(w, Qt.Key_Space)
    assert not bar.play_button.isChecked()
    qtbot.mouseClick(bar.leave_button, Qt.LeftButton)  # back to live (the demo model loads)
    assert [b.isEnabled() for b in engine_buttons] == [True, True, True, False, True]  # newest
    w.close()
