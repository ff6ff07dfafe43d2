"""The window's layout at small sizes: nothing widens it, every toolbar action stays reachable,
the requests table shows its rows, docks can be shown, hidden and reset from the View menu."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QPoint, Qt
from PySide6.QtWidgets import QToolBar
from window_testutil import bare_window, open_window, step

from kvscope.app.frames import RequestRow
from kvscope.app.window.docks import PANELS
from kvscope.engine.config import SamplingParams


def rows(n: int) -> list[RequestRow]:
    return [RequestRow(request_id=i, state="decode", prompt_tokens=1234, cached_tokens=1024,
                       output_tokens=17, ttft_s=0.0123, tpot_s=0.0045, cache_salt="tenant-a",
                       parent_id=None, text="")
            for i in range(n)]


def test_every_toolbar_action_is_visible_at_1280x720(qtbot, tmp_path):
    w = bare_window(qtbot, tmp_path)
    toolbars = w.findChildren(QToolBar)
    assert toolbars
    for tb in toolbars:
        for action in tb.actions():
            widget = tb.widgetForAction(action)
            if widget is None or not action.isVisible():
                continue
            assert widget.isVisible(), action.text() or widget
            assert tb.rect().contains(widget.geometry()), action.text() or widget
    shown = {a.text() for tb in toolbars for a in tb.actions()}
    assert {"Run demo ▶", "Pause ❚❚", "Record ●", "Apply (reload)"} <= shown
    w.close()


@pytest.mark.parametrize("reset", [False, True])
def test_the_requests_table_shows_five_rows_at_1280x720(qtbot, tmp_path, reset):
    w = bare_window(qtbot, tmp_path)
    if reset:
        w.act_reset_layout.trigger()
    w.requests.set_rows(rows(12))
    table = w.requests.table

    def fully_shown() -> int:  # the table scrolls to the newest rows: count, wherever they are
        return sum(table.rowViewportPosition(r) >= 0 and table.rowViewportPosition(r)
                   + table.rowHeight(r) <= table.viewport().height() for r in range(12))

    qtbot.waitUntil(lambda: fully_shown() >= 5)
    assert w.height() == 720
    w.close()


def test_selecting_a_request_with_a_long_block_table_keeps_the_window_width(qtbot, tmp_path):
    w = open_window(qtbot, tmp_path)
    w.resize(1280, 720)
    w.resizeDocks([w.docks["requests"]], [300], Qt.Horizontal)  # narrower than the title
    qtbot.waitUntil(lambda: w.width() == 1280 and w.docks["requests"].width() <= 310)
    w.engine_client.submit("a long prompt about blocks " * 120, SamplingParams(max_tokens=4), None)
    step(w, qtbot, 1)
    table = w.snapshot.block_tables[0]
    assert len(table) > 30
    widths = {n: d.width() for n, d in w.docks.items() if d.isVisible()}
    qtbot.mouseClick(w.requests.table.viewport(), Qt.LeftButton,
                     pos=w.requests.table.visualRect(w.requests.model.index(0, 0)).center())
    qtbot.waitUntil(lambda: w.requests.block_table_title.text().startswith("Block table of #0"))
    for _ in range(5):
        qtbot.wait(20)
        assert w.width() == 1280
        assert {n: d.width() for n, d in w.docks.items() if d.isVisible()} == widths
    # Nothing in the panel asks for more room than it has (a window manager would grow the
    # window to give it).
    assert w.requests.minimumSizeHint().width() <= w.docks["requests"].width()
    w.close()


def test_the_view_menu_hides_shows_and_resets_every_dock(qtbot, tmp_path):
    w = bare_window(qtbot, tmp_path)
    listed = {a.text() for a in w.view_menu.actions()}
    assert {d.windowTitle() for d in w.docks.values()} <= listed
    assert "Reset layout" in listed
    timeline = w.docks["timeline"]
    timeline.toggleViewAction().trigger()
    assert not timeline.isVisible()
    w.docks["requests"].setFloating(True)
    w.act_reset_layout.trigger()
    qtbot.waitUntil(timeline.isVisible)
    assert not w.docks["requests"].isFloating()
    assert w.dockWidgetArea(w.docks["requests"]) == Qt.LeftDockWidgetArea
    assert w.size().width() == 1280 and w.size().height() == 720
    w.close()


def test_a_squeezed_layout_is_never_restored_below_the_docks_minimums(qtbot, tmp_path):
    small = bare_window(qtbot, tmp_path, size=(700, 500), name="squeezed.ini")
    small.close()  # saves the squeezed layout
    big = bare_window(qtbot, tmp_path, size=(1400, 900), name="squeezed.ini")
    for name in ("timeline", "requests", "tree"):
        dock = big.docks[name]
        if dock.isVisible() and not dock.visibleRegion().isEmpty():
            w, h = next(row.min_size for row in PANELS if row.name == name)
            assert dock.widget().width() >= w and dock.widget().height() >= h, name
    big.close()


def test_recording_never_shifts_the_toolbar_and_the_status_bar_says_running_paused_recording(
        window, qtbot, tmp_path):
    tb = window.findChild(QToolBar, "toolbar_main")
    record = tb.widgetForAction(window.act_record)
    after = tb.widgetForAction(window.act_open_session)
    before = (record.width(), after.x())
    window.setFocus()
    qtbot.keyClick(window, Qt.Key_F5)
    qtbot.waitUntil(lambda: window.status.text().endswith("· running"), timeout=10_000)
    qtbot.mouseClick(tb.widgetForAction(window.act_pause), Qt.LeftButton)
    qtbot.waitUntil(lambda: window.status.text().endswith("· paused · F5 resumes"), timeout=10_000)
    assert not window.running
    path = tmp_path / "s.kvscope"
    window.start_recording(str(path))
    qtbot.waitUntil(lambda: window.recording_path == str(path), timeout=5000)
    assert window.act_record.text() == "Stop recording ■"
    assert window.recording_label.isVisible()
    assert window.recording_label.text() == "● recording s.kvscope"
    assert (record.width(), after.x()) == before
    qtbot.mouseClick(record, Qt.LeftButton)  # stop
    qtbot.waitUntil(lambda: window.recording_path is None, timeout=5000)
    assert window.recording_label.text() == "" and window.act_record.text() == "Record ●"
    assert (record.width(), after.x()) == before


def test_the_pace_box_slows_the_demo_to_a_watchable_rate(window, qtbot):
    import time

    window.pace_box.setFocus()
    window.pace_box.lineEdit().selectAll()
    qtbot.keyClicks(window.pace_box.lineEdit(), "5")
    qtbot.keyClick(window.pace_box.lineEdit(), Qt.Key_Return)
    assert window.pace_box.value() == 5
    window.setFocus()
    qtbot.keyClick(window, Qt.Key_F5)
    qtbot.waitUntil(lambda: window.engine.num_steps >= 1, timeout=10_000)
    first, t0 = window.engine.num_steps, time.monotonic()
    qtbot.wait(1500)
    steps, elapsed = window.engine.num_steps - first, time.monotonic() - t0
    assert 1 <= steps <= elapsed * 5 + 2, (steps, elapsed)  # at most 5 a second
    window.pause()


def test_a_long_model_name_shows_its_start_in_the_narrow_model_box(qtbot, tmp_path):
    w = bare_window(qtbot, tmp_path)
    box = w.model_box
    box.setCurrentIndex(1)  # SmolLM2, shown (picking it would load it)
    assert box.currentText() == "SmolLM2-135M-Instruct (real)"
    edit = box.lineEdit()
    assert edit.fontMetrics().horizontalAdvance(box.currentText()) > edit.width()  # too long
    qtbot.waitUntil(lambda: edit.cursorRect().left() < 8)  # scrolled to its start, not its end
    w.close()


@pytest.mark.parametrize("size", [(1280, 720), (1600, 1000)])
def test_the_prompt_fields_keep_their_height_and_chat_mode_grows_the_dock(qtbot, tmp_path, size):
    """A short Prompt dock once squeezed its fields to unreadable slivers; now they keep their
    height (the form scrolls), and ticking "chat" makes room for the transcript where the
    window has it."""
    w = bare_window(qtbot, tmp_path, size=size)
    c = w.composer
    fields = [c.prompt, c.max_tokens, c.temperature, c.n, c.salt, c.submit_button, c.chat]

    def squeezed() -> list:  # below the minimum the layout would give (set, else hinted)
        return [f for f in fields if f.isVisible()
                and f.height() < (f.minimumHeight() or f.minimumSizeHint().height())]

    assert squeezed() == []
    if size == (1280, 720):  # the default layout shows every field of a plain prompt unscrolled
        assert c.form.height() <= c.form.parentWidget().height()
    before = w.docks["requests"].height()
    qtbot.mouseClick(c.chat, Qt.LeftButton, pos=QPoint(8, c.chat.height() // 2))  # the box
    assert c.chat.isChecked()
    fields += [c.transcript, c.new_chat_button]
    qtbot.waitUntil(lambda: c.transcript.isVisible() and c.new_chat_button.isVisible())
    qtbot.waitUntil(lambda: w.docks["requests"].height() < before)  # the dock grew
    assert squeezed() == []
    if size == (1600, 1000):  # room for all of it: nothing to scroll
        qtbot.waitUntil(lambda: c.form.parentWidget().height() >= c.needed_height())
    assert w.size().width() == size[0] and w.size().height() == size[1]
    w.close()


def test_a_pause_before_the_first_step_comes_back_says_paused(window, qtbot):
    """F5 then Space at once: on a busy machine the pause lands before the engine process's
    first step reaches the window; the status bar still says paused (it said nothing)."""
    assert window.engine.num_steps == 0
    window.setFocus()
    qtbot.keyClick(window, Qt.Key_F5)
    qtbot.keyClick(window, Qt.Key_Space)
    qtbot.waitUntil(lambda: window.status.text().endswith("· paused · F5 resumes"),
                    timeout=10_000)
    # The state that race leaves, whether or not this run hit it: stopped, work left, no step.
    window.engine.num_steps = 0
    window.frame_pump.show_status()
    assert window.status.text().endswith("· paused · F5 resumes")
