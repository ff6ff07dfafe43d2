"""The panels' seam: a panel is one file and one row of `docks.PANELS`. A dummy registered in that
row only is built, docked and tabbed as its row says, listed in the View menu (a click there hides
and shows it), shown the frames of the demo run and of a session, and cleared whenever another
source is shown."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel
from window_testutil import open_window, pause

from kvscope.app.panels import Panel
from kvscope.app.window import docks
from kvscope.sessions import SessionReader


class DummyPanel(QLabel):
    def __init__(self, selection):
        super().__init__("dummy")
        self.selection = selection
        self.log = []  # ("frame", frame) and ("clear", None), in the order they came

    def show_frame(self, frame) -> None:
        self.log.append(("frame", frame))

    def clear(self) -> None:
        self.log.append(("clear", None))

    def frames(self) -> list:
        return [f for kind, f in self.log if kind == "frame"]


@pytest.fixture
def dummy(monkeypatch):
    built = []

    def make(selection):
        built.append(DummyPanel(selection))
        return built[-1]

    row = docks.PanelRow("dummy", "Dummy panel", make, docks.RIGHT, "notes", (120, 60))
    monkeypatch.setattr(docks, "PANELS", (*docks.PANELS, row))
    return built


def click_in_view_menu(w, qtbot, action) -> None:
    menu = w.view_menu
    menu.popup(w.mapToGlobal(w.rect().center()))
    qtbot.waitUntil(menu.isVisible)
    qtbot.mouseClick(menu, Qt.LeftButton, pos=menu.actionGeometry(action).center())
    qtbot.waitUntil(lambda: not menu.isVisible())


def test_a_panel_in_one_row_of_PANELS_is_built_docked_listed_shown_frames_and_cleared(
        dummy, qtbot, tmp_path):
    w = open_window(qtbot, tmp_path)
    try:
        (panel,) = dummy
        assert isinstance(panel, Panel) and w.dummy is panel and w.panels["dummy"] is panel
        assert panel.selection is w.selection
        dock = w.docks["dummy"]
        assert dock.objectName() == "dock_dummy" and dock.windowTitle() == "Dummy panel"
        assert dock.widget() is panel and panel.minimumSize().toTuple() == (120, 60)
        assert w.dockWidgetArea(dock) == Qt.RightDockWidgetArea
        assert dock in w.tabifiedDockWidgets(w.docks["details"])  # its tab group: "notes"

        action = dock.toggleViewAction()
        assert action in w.view_menu.actions() and action.text() == "Dummy panel"
        click_in_view_menu(w, qtbot, action)
        assert dock.isHidden()
        click_in_view_menu(w, qtbot, action)
        assert not dock.isHidden()

        # the model loaded: the live source was shown afresh, cleared first
        assert ("clear", None) in panel.log
        panel.log.clear()
        w.act_demo.trigger()  # Run demo (F5)
        qtbot.waitUntil(lambda: any(f.snapshot is not None and f.snapshot.step >= 3
                                    for f in panel.frames()), timeout=60_000)
        pause(w, qtbot)
        assert any(f.records for f in panel.frames())
        newest = w.snapshot.step

        # a session: cleared, then its steps
        with SessionReader(w.engine.history_path) as history:  # written by the engine process
            qtbot.waitUntil(lambda: (history.refresh(), history.last_step)[1] >= newest,
                            timeout=10_000)
        panel.log.clear()
        assert w.open_session(w.engine.history_path)
        assert panel.log[0] == ("clear", None) and panel.log.count(("clear", None)) == 1
        assert any(f.records for f in panel.frames())  # the timeline's and the log's share
        first = w.reader.first_step
        assert panel.frames()[-1].snapshot.step == first
        w.selection.select_step(first + 2)  # the time cursor: every panel shows that step
        assert panel.frames()[-1].snapshot.step == first + 2

        # back to live: cleared again, then everything the live source has
        panel.log.clear()
        w.leave_replay()
        assert panel.log[0] == ("clear", None)
        assert panel.frames() and panel.frames()[-1].snapshot.step == newest
    finally:
        w.close()
