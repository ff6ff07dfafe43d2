"""Issue 26, item 8: the tools (Cache lab, Experiments) open from their shortcut or the View
menu on top, focused and readable (a plot >= 150 px tall, >= 5 table rows, inside the screen)
on a 1280x720 and a 1600x1000 screen; warm-prefix's fractions read as percent ticks; the View
menu lists the docks as the user meets them, then the tools; a lab window steps aside for the
replay it opens.

The screen-size tests run the window in a child process on a screen of that size (Qt's
offscreen platform with a screen configuration): the suite's own offscreen screen is 800x800,
and the platform is chosen once per process. Run as a script, this file is that child: it
drives the window with QTest's clicks and keys and prints what it measured as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SIZES = [(1280, 720), (1600, 1000)]
IDS = ["1280x720", "1600x1000"]
HEAD = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_head200.jsonl"


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict:
    """What the child measured, by screen ("1280x720"): one process, one screen each size."""
    tmp = tmp_path_factory.mktemp("screens")
    config = tmp / "screens.json"
    config.write_text(json.dumps({"screens": [dict(
        name=f"{w}x{h}", x=sum(s[0] for s in SIZES[:i]), y=0, width=w, height=h,
        logicalDpi=96, logicalBaseDpi=96, dpr=1) for i, (w, h) in enumerate(SIZES)]}))
    env = {**os.environ, "QT_QPA_PLATFORM": f"offscreen:configfile={config}"}
    done = subprocess.run([sys.executable, __file__, str(tmp)], env=env, text=True,
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("size", SIZES, ids=IDS)
def test_each_tool_opens_on_top_focused_and_readable(seen, size):
    seen = seen["{}x{}".format(*size)]
    left, top, width, height = seen["screen"]
    assert (width, height) == size
    for opened in ("lab by Ctrl+Shift+L", "experiments from the View menu",
                   "experiments by Ctrl+Shift+E", "lab docked again, then opened"):
        tool = seen[opened]
        assert tool["visible"] and tool["on_top"], (opened, tool)  # the plot and table uncovered
        assert tool["active"] and tool["focused"], (opened, tool)  # the keys go to it
        x, y, w, h = tool["frame"]
        assert left <= x and top <= y and x + w <= left + width and y + h <= top + height, (
            opened, tool)
        assert tool["plot_height"] >= 150 and tool["view_height"] >= 100, (opened, tool)
        assert tool["table_rows"] >= 5, (opened, tool)
    assert seen["shortcut hides"]  # Ctrl+Shift+E again, in the tool's window: it hides
    ticks = seen["warm-prefix x ticks"]
    assert len(ticks) >= 3 and all(t.endswith("%") for t in ticks), ticks
    assert {"0%", "50%"} <= set(ticks) and "x0.001" not in seen["warm-prefix x label"]


def view_menu_groups(w) -> list[list[str]]:
    """The View menu's entries, in groups between separators."""
    groups = [[]]
    for action in w.view_menu.actions():
        if action.isSeparator():
            groups.append([])
        else:
            groups[-1].append(action.text())
    return groups


@pytest.mark.parametrize("size", SIZES, ids=IDS)
def test_the_view_menu_lists_the_docks_as_the_user_meets_them_then_the_tools(
        qtbot, tmp_path, size):
    from window_testutil import bare_window

    w = bare_window(qtbot, tmp_path, size)
    docks, tools, *_ = view_menu_groups(w)
    # left column; right column: the tree's tabs, then Details' tabs; the bottom's tabs
    assert docks == ["Requests", "Prompt", "Prefix tree", "Capacity", "Device",
                     "Details / Why it missed", "Text", "Timeline", "Events"]
    assert tools == ["Cache lab", "Experiments"]
    shortcuts = {a.text(): a.shortcut().toString() for a in w.view_menu.actions()}
    assert shortcuts["Cache lab"] == "Ctrl+Shift+L" and shortcuts["Experiments"] == "Ctrl+Shift+E"
    w.close()


def test_the_lab_window_steps_aside_for_the_replay_it_opens(qtbot, tmp_path):
    from PySide6.QtCore import Qt
    from test_lab_window import fill, table
    from window_testutil import bare_window

    from kvscope.app.sources.lab import LabSource

    w = bare_window(qtbot, tmp_path, (1280, 720))
    activate(qtbot, w)
    qtbot.keyClick(w.pool, Qt.Key_L, Qt.ControlModifier | Qt.ShiftModifier)
    lab, dock = w.lab, w.docks["lab"]
    assert dock.isVisible() and dock.isFloating()  # over the window, covering the pool
    show_rows(lab)
    rows = table(lab)
    fill(lab, HEAD, "300 1000", 20)
    qtbot.mouseClick(lab.open_button, Qt.LeftButton)
    assert not dock.isVisible()  # the replay is not hidden behind it
    assert "Ctrl+Shift+L" in w.statusBar().currentMessage()
    qtbot.waitUntil(lambda: isinstance(w.source, LabSource), timeout=20_000)
    assert w.pool.isVisible() and not w.pool.visibleRegion().isEmpty()
    activate(qtbot, w)
    qtbot.keyClick(w.pool, Qt.Key_L, Qt.ControlModifier | Qt.ShiftModifier)
    assert dock.isVisible() and table(lab) == rows  # back as it was
    w.close()


def activate(qtbot, w) -> None:
    """The window has the keys (its shortcuts work), as after a click on it."""
    from PySide6.QtWidgets import QApplication

    w.activateWindow()
    qtbot.waitUntil(lambda: QApplication.activeWindow() is w)


def show_rows(lab) -> None:
    """Eight rows of a lab run, as its worker hands them over."""
    from kvscope.lab.report import Row

    rows = [Row(p, n, 16, "sequential", 0.1 * k, 0.2 * k, 100 * k)
            for k, (p, n) in enumerate((p, n) for p in ("lru", "belady")
                                       for n in (300, 1000, 2000, 4000))]
    lab.show_result([(n, 0.1 * k) for k, n in enumerate((300, 1000, 2000, 4000))], rows)


# ---------------------------------------------------------------------- the child process
def measure(w, dock, panel, focus) -> dict:
    """What the user sees of a tool: its window on top over its plot and table, the keys going
    to `focus`, its frame on screen, the plot's and the table's readable size."""
    from PySide6.QtWidgets import QApplication

    def uncovered(widget) -> bool:
        at = QApplication.widgetAt(widget.mapToGlobal(widget.rect().center()))
        return at is not None and (at is widget or widget.isAncestorOf(at))

    table = panel.table
    viewport = table.viewport().height()
    rows = sum(table.rowViewportPosition(r) >= 0 and
               table.rowViewportPosition(r) + table.rowHeight(r) <= viewport
               for r in range(table.rowCount()))
    frame = dock.frameGeometry() if dock.isFloating() else dock.geometry().translated(
        w.geometry().topLeft())
    return dict(visible=dock.isVisible() and not dock.visibleRegion().isEmpty(),
                on_top=uncovered(panel.plot) and uncovered(table),
                active=QApplication.activeWindow() is dock.window(),
                focused=QApplication.focusWidget() is focus,
                frame=list(frame.getRect()), plot_height=panel.plot.height(),
                view_height=panel.plot.getPlotItem().vb.height(), table_rows=rows)


def drawn_ticks(axis) -> list[str]:
    """The tick labels the axis paints (pyqtgraph's own draw specs)."""
    from PySide6.QtGui import QImage, QPainter

    image = QImage(10, 10, QImage.Format_ARGB32)
    painter = QPainter(image)
    try:
        _, _, texts = axis.generateDrawSpecs(painter)
    finally:
        painter.end()
    return [text for _rect, _flags, text in texts]


TMP = Path()  # the child's folder (its settings files)


def child() -> dict:
    """On each screen of the platform's configuration, what `on` measured."""
    from PySide6.QtGui import QGuiApplication
    from PySide6.QtWidgets import QApplication

    _app = QApplication([])
    return {s.name(): on(s.availableGeometry()) for s in QGuiApplication.screens()}


def on(screen) -> dict:
    """A fresh window as large as `screen` lets it be (a maximised one): open the tools."""
    from PySide6.QtCore import QDeadlineTimer, QPoint, QSettings, Qt
    from PySide6.QtTest import QTest
    from PySide6.QtWidgets import QApplication

    from kvscope.app.window.main_window import MainWindow
    from kvscope.lab.experiments import warm_prefix

    app = QApplication.instance()

    def until(condition, ms: int = 5000) -> None:
        deadline = QDeadlineTimer(ms)
        while not condition() and not deadline.hasExpired():
            QTest.qWait(20)

    def keys(key) -> None:
        QTest.keyClick(app.focusWidget() or w, key, Qt.ControlModifier | Qt.ShiftModifier)
        QTest.qWait(50)

    def from_view_menu(title: str) -> None:
        menu = w.view_menu
        menu.popup(w.mapToGlobal(QPoint(40, 40)))
        until(menu.isVisible)
        action = next(a for a in menu.actions() if a.text() == title)
        QTest.mouseClick(menu, Qt.LeftButton, pos=menu.actionGeometry(action).center())
        until(lambda: not menu.isVisible())
        QTest.qWait(50)

    w = MainWindow(settings=QSettings(str(TMP / f"{screen.width()}.ini"), QSettings.IniFormat))
    w.setGeometry(screen)
    w.show()
    QTest.qWaitForWindowExposed(w)
    w.activateWindow()
    until(lambda: app.activeWindow() is w)
    seen = {"screen": list(screen.getRect())}
    lab, experiments = w.lab, w.experiments

    keys(Qt.Key_L)
    show_rows(lab)
    QTest.qWait(50)
    seen["lab by Ctrl+Shift+L"] = measure(w, w.docks["lab"], lab, lab.path_edit)

    from_view_menu("Experiments")
    measured = [(f, f, 40 * (1 - f) + 4) for f in warm_prefix.FRACTIONS]
    experiments.show_result(warm_prefix.summarize(measured))
    QTest.qWait(50)
    seen["experiments from the View menu"] = measure(w, w.docks["experiments"], experiments,
                                                     experiments.choice)
    axis = experiments.plot.getPlotItem().getAxis("bottom")
    seen["warm-prefix x ticks"] = drawn_ticks(axis)
    seen["warm-prefix x label"] = axis.labelString()
    keys(Qt.Key_E)
    seen["shortcut hides"] = not w.docks["experiments"].isVisible()
    w.activateWindow()
    until(lambda: app.activeWindow() is w)
    keys(Qt.Key_E)
    seen["experiments by Ctrl+Shift+E"] = measure(w, w.docks["experiments"], experiments,
                                                  experiments.choice)

    dock = w.docks["lab"]  # the user docks the lab again (a double-click on its title) ...
    dock.setFloating(False)
    from_view_menu("Cache lab")  # ... hides it, and opens it again
    from_view_menu("Cache lab")
    seen["lab docked again, then opened"] = measure(w, dock, lab, lab.path_edit)
    w.close()
    return seen


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    TMP = Path(sys.argv[1])
    print(json.dumps(child()))
