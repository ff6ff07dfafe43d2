"""The tools shown on demand (Cache lab, Experiments: controls, a plot, a table, a verdict).
Opened from the View menu or their shortcut they come up on top, focused, and big enough to
read. Tabbed in the side column, as they once were, a 1280x720 window gave them 25-40 px plots
and 1.5 table rows, and the centre (the pool, about 500x420 there) is too small for controls, a
plot and a table: docked smaller than READABLE, a tool opens as a window of its own over the
main one, sized to fit the screen. It stays a dock: a double-click on its title docks it again,
and the layout remembers where it is."""

from __future__ import annotations

from PySide6.QtCore import QRect, QSize, Qt
from PySide6.QtWidgets import QDockWidget, QMainWindow

READABLE = QSize(640, 520)  # under the controls: a plot >= 150 px tall and 5 table rows
LARGEST = QSize(1100, 800)  # a larger window only spreads the same points out
SCREEN_SHARE = 0.9  # of the available screen, at most: the window's frame and a margin fit


def open_tool(window: QMainWindow, dock: QDockWidget) -> None:
    """Show a tool on top and focused (its panel's focus proxy takes the keys), at a usable
    size: as a window of its own when it is docked smaller than READABLE or does not fit."""
    dock.show()
    dock.raise_()  # docked: its tab to the front, and its docked size known from here on
    if not dock.isFloating() and _smaller(dock.size(), READABLE):
        dock.setFloating(True)
    if dock.isFloating() and not _fits(window, dock):
        frame, now, inner = tool_frame(window), dock.frameGeometry(), dock.geometry()
        dock.setGeometry(frame.adjusted(inner.left() - now.left(), inner.top() - now.top(),
                                        inner.right() - now.right(),
                                        inner.bottom() - now.bottom()))
    dock.raise_()
    dock.activateWindow()
    dock.widget().setFocus(Qt.ShortcutFocusReason)


def tool_frame(window: QMainWindow) -> QRect:
    """A tool window's place, its frame included: centred on the main window, inside the
    screen, LARGEST or 90 % of the screen."""
    screen = window.screen().availableGeometry()
    size = LARGEST.boundedTo(QSize(int(screen.width() * SCREEN_SHARE),
                                   int(screen.height() * SCREEN_SHARE)))
    rect = QRect(0, 0, size.width(), size.height())
    rect.moveCenter(window.frameGeometry().center())
    rect.moveLeft(max(screen.left(), min(rect.left(), screen.right() + 1 - rect.width())))
    rect.moveTop(max(screen.top(), min(rect.top(), screen.bottom() + 1 - rect.height())))
    return rect


def _fits(window: QMainWindow, dock: QDockWidget) -> bool:
    """On the screen, whole, and not smaller than readable (or than the screen allows)."""
    screen = window.screen().availableGeometry()
    least = READABLE.boundedTo(tool_frame(window).size())
    return screen.contains(dock.frameGeometry()) and not _smaller(dock.size(), least)


def _smaller(size: QSize, least: QSize) -> bool:
    return size.width() < least.width() or size.height() < least.height()


def step_aside(window: QMainWindow, dock: QDockWidget, shortcut: str | None):
    """A tool window that asks the main window to show something (the lab's replay) would
    cover it: it hides, keeping what it shows; the View menu (or its shortcut) brings it back.
    Returns what brings it back at once (when what it asked for failed)."""
    if not (dock.isFloating() and dock.isVisible()):
        return lambda: None
    dock.hide()
    back = f"{shortcut} or View → {dock.windowTitle()}" if shortcut else "View"
    window.statusBar().showMessage(f"{dock.windowTitle()} hidden to show the replay: "
                                   f"{back} brings it back", 8000)

    def come_back() -> None:
        window.statusBar().clearMessage()
        dock.show()
        dock.raise_()

    return come_back
