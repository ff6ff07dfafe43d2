"""The window's controls do what they say, at 1280x720 and 1600x1000 (issue 26, items 3, 5, 10
and part of 15): picking a model in the Model list loads it, and a failed load leaves the model
loaded named; the chat shows its last exchange and starts over with another model; Run demo
plays the demo again once it finished; in replay the engine's buttons are off and the replay
bar takes their keys."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from PySide6.QtCore import QEvent, QPoint, Qt
from PySide6.QtGui import QHelpEvent
from PySide6.QtWidgets import QApplication, QToolBar, QToolTip
from window_testutil import LOAD_TIMEOUT_MS, bare_window, open_replay

from kvscope.app.window import engine_controls
from kvscope.app.window.engine_controls import workloads_dir

SIZES = [(1280, 720), (1600, 1000)]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def chat_model(tmp_path):
    """The demo model's files in a folder of their own, its tokenizer with a chat template."""
    folder = tmp_path / "demo-with-a-chat-template"
    shutil.copytree(workloads_dir().parent / "demo", folder)
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": TEMPLATE}))
    return folder


def pick(qtbot, box, text: str) -> None:
    """Open the Model list and click an entry."""
    box.showPopup()
    view = box.view()
    qtbot.waitUntil(view.isVisible)
    rect = view.visualRect(box.model().index(box.findText(text), 0))
    qtbot.mouseClick(view.viewport(), Qt.LeftButton, pos=rect.center())


def type_model(qtbot, box, name: str, enter: bool = True) -> None:
    """Type a name into the Model box (it has the keyboard, its line edit the text)."""
    box.lineEdit().selectAll()
    qtbot.keyClicks(box, name)
    if enter:
        qtbot.keyClick(box, Qt.Key_Return)


def tooltip(qtbot, widget) -> str:
    """Hover the widget and ask for its tooltip (the QHelpEvent Qt sends once the pointer rests:
    the hover timer alone missed now and then under load offscreen); its text."""
    QToolTip.hideText()
    qtbot.mouseMove(widget.window(), QPoint(1, widget.window().height() - 1))  # away, then on
    middle = QPoint(widget.width() // 2, widget.height() // 2)
    qtbot.mouseMove(widget, middle)
    QApplication.sendEvent(widget, QHelpEvent(QEvent.ToolTip, middle, widget.mapToGlobal(middle)))
    qtbot.waitUntil(QToolTip.isVisible, timeout=5000)
    return QToolTip.text()


def loaded(qtbot, w, name: str) -> None:
    qtbot.waitUntil(lambda: w.engine is not None and not w.engine_client.loading
                    and w.model_name == name, timeout=LOAD_TIMEOUT_MS)


@pytest.mark.parametrize("size", SIZES)
def test_picking_a_model_loads_it_and_a_failed_load_names_the_model_still_loaded(
        qtbot, tmp_path, size):
    """Picking an entry did nothing until Apply; a failed load left the failed folder in the box,
    dropped the model's name from the status bar and put a class name in the banner."""
    w = bare_window(qtbot, tmp_path, size)
    box = w.model_box
    real = "SmolLM2-135M-Instruct (real)"
    rect = box.view().visualRect(box.model().index(box.findText(real), 0))
    assert box.view().fontMetrics().horizontalAdvance(real) < rect.width()  # listed whole
    pick(qtbot, box, "demo")
    loaded(qtbot, w, "demo")
    assert box.currentText() == "demo" and w.engine.model_name == "demo"
    bad = tmp_path / "a-model-folder-whose-config-is-broken"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    edit = box.lineEdit()
    type_model(qtbot, box, str(bad), enter=False)
    assert edit.fontMetrics().horizontalAdvance(str(bad)) > edit.width()  # the box cuts it...
    assert tooltip(qtbot, box).startswith(f"{bad}\n")  # ...its tooltip names it whole
    qtbot.keyClick(box, Qt.Key_Return)
    qtbot.waitUntil(w.banner.isVisible, timeout=LOAD_TIMEOUT_MS)
    message = w.banner.label.text()
    assert message.startswith(f"Could not load the model: cannot read {bad / 'config.json'}: ")
    assert "Error" not in message  # no "ModelLoadError: ..."
    assert box.currentText() == "demo" and box.findText(str(bad)) == -1
    assert w.engine.model_name == "demo"
    assert w.status.text().startswith("not loaded: ") and "demo still loaded" in w.status.text()
    w.close()


def last_exchange_shown(edit) -> bool:
    """The transcript's last question and its answer lie inside its viewport."""
    viewport = edit.viewport().rect()
    text = edit.toPlainText()
    start = text.rindex("user: ")
    top = edit.cursorRect(edit.cursorForPosition(QPoint(0, 0)))  # the first line shown
    shown_from = edit.cursorForPosition(QPoint(1, top.top() + 1)).position()
    bottom = edit.cursorForPosition(QPoint(viewport.width() - 1, viewport.height() - 1))
    return shown_from <= start and bottom.position() >= len(text)


@pytest.mark.parametrize("size", SIZES)
def test_the_chat_shows_its_last_exchange_and_starts_over_with_another_model(
        qtbot, tmp_path, size):
    """The transcript was 1.5 lines showing the first turn; the chat stayed on after a switch to
    the demo model, whose next submit failed citing a command-line flag."""
    w = bare_window(qtbot, tmp_path, size)
    c, folder = w.composer, chat_model(tmp_path)
    type_model(qtbot, w.model_box, str(folder))
    loaded(qtbot, w, str(folder))
    qtbot.mouseClick(c.chat, Qt.LeftButton, pos=QPoint(8, c.chat.height() // 2))
    assert c.chat.isChecked()
    c.max_tokens.setValue(6)
    for turn, question in enumerate(("What is a list?", "And a tuple?", "And a set?")):
        c.prompt.setFocus()
        qtbot.keyClicks(c.prompt, question)
        qtbot.mouseClick(c.submit_button, Qt.LeftButton)
        qtbot.waitUntil(lambda turn=turn: len(c.messages) == 2 * turn + 2, timeout=20_000)
    qtbot.wait(50)
    assert c.transcript.viewport().height() >= 3 * c.transcript.fontMetrics().lineSpacing()
    assert last_exchange_shown(c.transcript), c.transcript.toPlainText()
    pick(qtbot, w.model_box, "demo")
    loaded(qtbot, w, "demo")
    assert c.messages == [] and c.transcript.toPlainText() == ""  # a new chat
    assert not c.chat.isChecked() and not c.chat.isEnabled() and not c.transcript.isVisible()
    tip = c.chat.toolTip()  # what hovering the box shows
    assert tip.startswith("demo has no chat template: pick SmolLM2") and "--" not in tip
    w.close()


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


def test_run_demo_on_demo_hybrid_plays_the_long_context_demo_and_the_window_frees_blocks(
        qtbot, tmp_path):
    """demo-hybrid, picked from the Model list: F5 plays long_context.jsonl, and the pool soon
    shows both groups, with blocks the window released (cached, a null in the table)."""
    w = bare_window(qtbot, tmp_path)
    w.pace_box.setValue(0)
    pick(qtbot, w.model_box, "demo-hybrid (sliding window 128 on half the layers)")
    loaded(qtbot, w, "demo-hybrid")
    sent = []  # the workloads the window hands its engine process
    send = w.engine_client.run_workload
    w.engine_client.run_workload = lambda workload: (sent.append(workload), send(workload))
    qtbot.waitUntil(lambda: "Press Run demo (F5)" in w.status.text())
    w.activateWindow()  # back from the Model list's popup
    qtbot.waitUntil(w.isActiveWindow)
    w.setFocus()
    qtbot.keyClick(w, Qt.Key_F5)
    qtbot.waitUntil(lambda: len(sent) == 1)
    assert Path(sent[0].source).name == "long_context.jsonl"

    def released() -> bool:
        s = w.snapshot
        return s is not None and len(s.groups) == 2 and any(
            (t == -1).any() for t in s.more_tables[0].values())

    qtbot.waitUntil(released, timeout=20_000)
    s = w.snapshot
    assert [g.name for g in s.groups] == ["full attention", "sliding window 128"]
    assert "sliding window 128" in w.pool.title.text()
    w.engine_client.pause()
    w.close()
