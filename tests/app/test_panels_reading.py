"""Small readability fixes: short request states with the full reason as tooltip, the requests
table following new rows unless the user scrolled up, a collapsible "How to read", and the
cancel-load dialog appearing after 0.3 s."""

from __future__ import annotations

import time

from PySide6.QtCore import QSettings, Qt
from window_testutil import LOAD_TIMEOUT_MS, shown

from kvscope.app.frames import RequestRow
from kvscope.app.panels.details import DetailsPanel
from kvscope.app.panels.requests_panel import RequestsPanel
from kvscope.app.window.engine_controls import LOAD_DIALOG_MS
from kvscope.app.window.main_window import MainWindow


def row(i: int, state: str = "decode") -> RequestRow:
    return RequestRow(i, state, 100, 64, 3, 0.01, 0.002, None, None, "")


def test_finished_states_are_short_with_the_full_reason_as_tooltip(qtbot):
    panel = RequestsPanel()
    qtbot.addWidget(panel)
    states = ["waiting", "prefill", "decode", "finished: length", "finished: stop",
              "finished: cancelled", "finished: rejected"]
    panel.set_rows([row(i, s) for i, s in enumerate(states)])
    m = panel.model
    shown = [m.data(m.index(i, 1)) for i in range(len(states))]
    assert shown == ["waiting", "prefill", "decode", "done", "done", "cancelled", "rejected"]
    assert m.data(m.index(3, 1), Qt.ToolTipRole) == "finished: length"


def test_the_table_follows_new_requests_unless_the_user_scrolled_up(qtbot):
    panel = shown(qtbot, RequestsPanel(), (500, 300))
    table = panel.table

    def visible(r: int) -> bool:
        y = table.rowViewportPosition(r)
        return y >= 0 and y + table.rowHeight(r) <= table.viewport().height()

    panel.set_rows([row(i) for i in range(3)])
    panel.set_rows([row(i) for i in range(40)])
    qtbot.waitUntil(lambda: visible(39))
    table.setFocus()
    qtbot.keyClick(table, Qt.Key_Home)  # the user goes back to the first rows
    qtbot.waitUntil(lambda: visible(0))
    panel.set_rows([row(i) for i in range(45)])
    qtbot.wait(50)
    assert visible(0) and not visible(44)


def test_how_to_read_collapses_and_gives_the_answer_its_room(qtbot):
    panel = DetailsPanel()
    qtbot.addWidget(panel)
    panel.resize(380, 300)
    panel.show()
    qtbot.waitExposed(panel)
    before = panel.text.height()
    qtbot.mouseClick(panel.help_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: not panel.help.isVisible())
    qtbot.waitUntil(lambda: panel.text.height() > before)
    qtbot.mouseClick(panel.help_button, Qt.LeftButton)
    qtbot.waitUntil(panel.help.isVisible)


def test_the_cancel_load_dialog_appears_after_a_third_of_a_second(qtbot, tmp_path):
    slow = tmp_path / "slow_start.py"  # run by the engine process before it serves
    slow.write_text("import time\ntime.sleep(1.5)\n")  # a forked one starts in well under 1 s
    w = MainWindow(settings=QSettings(str(tmp_path / "k.ini"), QSettings.IniFormat),
                   engine_setup=str(slow))
    qtbot.addWidget(w)
    w.show()
    t0 = time.monotonic()
    w.load_model("demo")
    qtbot.waitUntil(w.progress.isVisible, timeout=2500)  # well before the old 4 s
    # Not before its time (Qt's coarse timers may fire a few percent early).
    assert w.engine is None and time.monotonic() - t0 >= 0.8 * LOAD_DIALOG_MS / 1000
    qtbot.waitUntil(lambda: w.engine is not None, timeout=LOAD_TIMEOUT_MS)
    qtbot.waitUntil(lambda: not w.progress.isVisible())
    w.close()
