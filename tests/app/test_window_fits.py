"""The window fits the screen it opens on, at 1280x720 and 1600x1000 (the offscreen screens of
tests/offscreen_screens.json, the mouse put on one as a user's is): the first launch, a replay,
a lab replay, an attached server, docks floated and docked again, Reset layout and a relaunch
never make it (or what it asks for) wider or taller than the screen's free area; a saved layout
that does not fit is not restored. In the first layout every panel gets what it needs to be read."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from PySide6.QtCore import QEvent, QPoint, QPointF, QRect, QRectF, QSettings, QSize, Qt
from PySide6.QtGui import QCursor, QGuiApplication, QMouseEvent
from PySide6.QtWidgets import QApplication
from test_layout import rows
from test_side_panels_fit import click_tab

from kvscope.app.sources.lab import LabSource
from kvscope.app.window.main_window import MainWindow

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sessions"))
from kv_fake_publisher import FakePublisher, batch, stored  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data"
HEAD = DATA / "mooncake_conversation_head200.jsonl"
SESSION = DATA / "session_before_step_stream.kvscope"
SIZES = [QSize(1280, 720), QSize(1600, 1000)]


@pytest.fixture(params=SIZES, ids=lambda s: f"{s.width()}x{s.height()}")
def screen(request, qapp) -> str:
    """The name of a screen of that size, with the mouse on it (where a window first opens).
    Only its name is kept: PySide6 ties a QScreen's Python object to the widget whose screen()
    returned it, and invalidates it once that widget is deleted (the C++ screen lives on)."""
    name = f"{request.param.width()}x{request.param.height()}"
    assert name in [s.name() for s in QGuiApplication.screens()], \
        "no such screen: run offscreen (tests/conftest.py gives it the screens)"
    before = QCursor.pos()
    QCursor.setPos(area(name).center())
    yield name
    QCursor.setPos(before)


def area(name: str) -> QRect:
    """The free area of the screen of that name."""
    (screen,) = [s for s in QGuiApplication.screens() if s.name() == name]
    return screen.availableGeometry()


def launch(qtbot, ini: Path) -> MainWindow:
    """kvscope as `kvscope` starts it (gui.main: built, shown), its layout saved in ini."""
    w = MainWindow(settings=QSettings(str(ini), QSettings.IniFormat))
    qtbot.addWidget(w)
    w.show()
    qtbot.waitExposed(w)
    return w


def assert_fits(qtbot, w: MainWindow, screen: str, when: str) -> None:
    """The window, frame and all, lies on the screen's free area, and asks for no more."""
    qtbot.wait(30)  # a layout that grows the window does so once the event loop runs
    free = area(screen)
    assert w.screen().name() == screen, when
    assert free.contains(w.frameGeometry()), (when, w.frameGeometry(), free)
    need = w.minimumSizeHint().expandedTo(w.minimumSize())
    assert need.width() <= free.width() and need.height() <= free.height(), (when, need, free)


def redock(qtbot, dock) -> None:
    """Double-click its title: it floats; double-click the floating window's title (drawn by the
    window manager): it docks where it was."""
    qtbot.mouseDClick(dock, Qt.LeftButton, pos=QPoint(dock.width() // 2, 6))
    qtbot.waitUntil(dock.isFloating)
    at = QPointF(dock.width() / 2, -10)
    QApplication.sendEvent(dock, QMouseEvent(QEvent.NonClientAreaMouseButtonDblClick, at,
                                             dock.mapToGlobal(at), Qt.LeftButton, Qt.LeftButton,
                                             Qt.NoModifier))
    qtbot.waitUntil(lambda: not dock.isFloating())


def test_the_window_fits_the_screen_from_first_launch_to_relaunch(qtbot, tmp_path, screen):
    ini = tmp_path / "kvscope.ini"
    w = launch(qtbot, ini)
    assert_fits(qtbot, w, screen, "first launch")
    assert w.width() >= min(1400, area(screen).width() - 16)  # and uses it
    missing = tmp_path / ("nosuchsession" * 16 + ".kvscope")  # one long word, in the banner
    assert not w.open_session(str(missing)) and w.banner.isVisible()
    assert_fits(qtbot, w, screen, "a banner with a long path")
    assert w.open_session(str(SESSION))
    assert_fits(qtbot, w, screen, "replay")
    bar = w.replay_bar  # its controls wrap: every one is shown, whole, inside the bar
    for button in (bar.first_button, bar.play_button, bar.jump_button, bar.leave_button):
        assert button.isVisible() and button.visibleRegion().boundingRect() == button.rect()
        assert bar.rect().contains(button.geometry().translated(button.parentWidget().pos()))
    assert w.open_lab_replay(str(HEAD), 300, 16, "lru", 40)
    qtbot.waitUntil(lambda: isinstance(w.source, LabSource), timeout=30_000)
    assert_fits(qtbot, w, screen, "lab replay")
    fake = FakePublisher()
    try:
        assert w.attach(fake.endpoint, fake.replay_endpoint)
        fake.wait_subscribed(timeout_s=10)
        fake.send(0, batch([stored(list(range(1, 40)), None)]))
        qtbot.waitUntil(lambda: w.snapshot is not None and w.snapshot.num_cached_blocks == 39,
                        timeout=5000)
        assert_fits(qtbot, w, screen, "attached")
        for name in ("requests", "tree", "timeline"):
            redock(qtbot, w.docks[name])
            assert_fits(qtbot, w, screen, f"{name} floated and docked again")
        w.act_detach.trigger()
    finally:
        fake.close()
    free = area(screen)
    w.resize(free.width() + 200, free.height() + 100)  # made larger than the screen by hand
    w.act_reset_layout.trigger()
    assert_fits(qtbot, w, screen, "Reset layout")
    assert w.width() >= min(1400, free.width() - 16)
    size, requests = w.size(), w.docks["requests"].width()
    w.close()
    again = launch(qtbot, ini)
    assert_fits(qtbot, again, screen, "relaunch")
    assert again.size() == size and again.docks["requests"].width() == requests  # restored
    again.close()


def test_a_saved_layout_that_does_not_fit_the_screen_is_not_restored(qtbot, tmp_path, screen):
    """A window made larger than the screen (as a replay once did), closed: the next launch
    opens in the default layout, fitted to the screen, not in the squeezed one."""
    ini = tmp_path / "kvscope.ini"
    w = launch(qtbot, ini)
    free = area(screen)
    w.resize(free.width() + 300, free.height() + 100)
    w.resizeDocks([w.docks["requests"]], [900], Qt.Horizontal)
    qtbot.waitUntil(lambda: w.docks["requests"].width() >= 850)
    w.close()
    again = launch(qtbot, ini)
    assert_fits(qtbot, again, screen, "relaunch after a layout wider than the screen")
    assert again.width() >= min(1400, free.width() - 16)
    requests = again.docks["requests"].width()
    assert abs(requests - 0.33 * again.width()) < 40, requests  # the default share, not 900 px
    again.close()


def inside(widget, outer) -> bool:
    """widget lies wholly inside outer's rectangle, as drawn."""
    return outer.rect().contains(QRect(widget.mapTo(outer, QPoint(0, 0)), widget.size()))


def lines(widget) -> float:
    return widget.height() / widget.fontMetrics().lineSpacing()


@pytest.mark.parametrize("reset", [False, True], ids=["first launch", "Reset layout"])
def test_every_panel_can_be_read_in_the_first_layout(qtbot, tmp_path, screen, reset):
    """The layout a newcomer gets on this screen: at least 5 request rows, Details' help whole
    above an answer of several lines, Capacity's four results unscrolled and its table one
    scroll away, Device's two charts tall enough to read, their titles apart."""
    w = launch(qtbot, tmp_path / "kvscope.ini")
    w.frame_timer.stop()
    if reset:
        w.act_reset_layout.trigger()
    assert_fits(qtbot, w, screen, "launch")
    w.requests.set_rows(rows(12))
    table = w.requests.table
    qtbot.waitUntil(lambda: sum(
        table.rowViewportPosition(r) >= 0 and table.rowViewportPosition(r) + table.rowHeight(r)
        <= table.viewport().height() for r in range(12)) >= 5)
    details = w.details
    assert details.help.isVisible() and not details.help_area.verticalScrollBar().isVisible()
    assert lines(details.text.viewport()) >= 4, lines(details.text.viewport())
    cap = w.capacity
    click_tab(qtbot, w, "Capacity")
    qtbot.waitUntil(lambda: not w.docks["capacity"].visibleRegion().isEmpty())
    for label in (cap.bytes_per_token_label, cap.tokens_fit_label, cap.bytes_per_request_label,
                  cap.requests_fit_label):
        assert inside(label, cap.scroll.viewport()), label.text()  # shown without scrolling
    cap.scroll.ensureWidgetVisible(cap.table)
    qtbot.wait(20)
    assert inside(cap.table, cap.scroll.viewport())  # the table, whole, one scroll away
    device = w.device
    click_tab(qtbot, w, "Device")
    qtbot.waitUntil(lambda: not w.docks["device"].visibleRegion().isEmpty())
    charts, titles = QRectF(device.glw.rect()).adjusted(-2, -2, 2, 2), []
    for plot in (device.memory_plot, device.lower_plot):
        assert plot.vb.height() >= 70, plot.vb.height()  # px of data
        label = plot.getAxis("left").label  # its rotated title
        titles.append(label.mapRectToScene(label.boundingRect()))
        assert charts.contains(titles[-1]), (titles[-1], charts)  # drawn whole
    assert titles[0].bottom() <= titles[1].top(), titles  # one above the other, apart

