"""The window's panels, one row of `PANELS` each: from it a panel is built, docked, tabbed, listed
in the View menu, shown frames and cleared (the window loops over `Docks.panels`), and put back
by Reset layout. A new panel is one file in app/panels/ and one row here. The window fits the
screen it is on: at the first launch, after Reset layout, and a saved layout that would not fit
is not restored."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from PySide6.QtCore import QRect, QSettings, QSize, Qt
from PySide6.QtGui import QAction, QCursor, QGuiApplication, QKeySequence
from PySide6.QtWidgets import QDockWidget, QMainWindow, QStyle, QTabBar, QWidget

from kvscope.app.panels import Panel
from kvscope.app.panels.capacity_panel import CapacityPanel
from kvscope.app.panels.composer import Composer
from kvscope.app.panels.details import DetailsPanel
from kvscope.app.panels.device_panel import DevicePanel
from kvscope.app.panels.events_panel import EventsPanel
from kvscope.app.panels.experiments_panel import ExperimentsPanel
from kvscope.app.panels.lab_panel import LabPanel
from kvscope.app.panels.pool_view import PoolView
from kvscope.app.panels.prefix_tree_panel import PrefixTreePanel
from kvscope.app.panels.requests_panel import RequestsPanel
from kvscope.app.panels.text_panel import TextPanel
from kvscope.app.panels.timeline import Timeline
from kvscope.app.selection import Selection
from kvscope.app.window.tool_windows import open_tool, step_aside

LEFT, RIGHT, BOTTOM = Qt.LeftDockWidgetArea, Qt.RightDockWidgetArea, Qt.BottomDockWidgetArea
FIRST_SIZE = QSize(1400, 900)  # the first launch's size, where the screen has room for it
BORDER = 4  # px: a window frame's side, as a window manager draws it, before it is known


@dataclass(frozen=True)
class PanelRow:
    name: str  # the window's attribute; its dock is "dock_<name>" (the name saved layouts keep)
    title: str  # the dock's title, and its entry in the View menu
    make: Callable[[Selection], QWidget]  # the panel (a Panel), given the window's selection
    area: Qt.DockWidgetArea | None  # where it docks by default (None: the central view, the pool)
    tab_group: str | None = None  # the docks of a group are tabbed together, the first on top
    min_size: tuple[int, int] | None = None  # the smallest it is readable at (a restored
    #                                          layout never squeezes it more)
    on_demand: bool = False  # a tool: hidden until the View menu (or its shortcut) opens it
    shortcut: str | None = None  # shows and hides its dock


def _alone(cls) -> Callable[[Selection], QWidget]:
    """A panel that does not follow the selection."""
    return lambda _selection: cls()


PANELS: tuple[PanelRow, ...] = (
    PanelRow("pool", "Block pool", PoolView, None),
    PanelRow("requests", "Requests", RequestsPanel, LEFT, min_size=(260, 180)),
    PanelRow("composer", "Prompt", _alone(Composer), LEFT, min_size=(200, 120)),
    PanelRow("tree", "Prefix tree", PrefixTreePanel, RIGHT, "tools", (200, 150)),
    PanelRow("details", "Details / Why it missed", DetailsPanel, RIGHT, "notes", (200, 80)),
    PanelRow("capacity", "Capacity", _alone(CapacityPanel), RIGHT, "tools", (200, 150)),
    PanelRow("device", "Device", _alone(DevicePanel), RIGHT, "tools", (200, 120)),
    # the tools (app/window/tool_windows.py): windows of their own when opened, or tabbed here
    PanelRow("lab", "Cache lab", _alone(LabPanel), RIGHT, "tools", on_demand=True,
             shortcut="Ctrl+Shift+L"),
    PanelRow("experiments", "Experiments", _alone(ExperimentsPanel), RIGHT, "tools",
             on_demand=True, shortcut="Ctrl+Shift+E"),
    PanelRow("timeline", "Timeline", Timeline, BOTTOM, "time", (300, 170)),
    PanelRow("events", "Events", EventsPanel, BOTTOM, "time", (300, 100)),
    PanelRow("text", "Text", TextPanel, RIGHT, "notes", (200, 100)),
)


class Docks:
    """The panels of `PANELS` (read when the window is built), by name in its order, and the
    docks of those that dock; `place` them once the window has its central view."""

    def __init__(self, window: QMainWindow, selection: Selection):
        self.window = window
        self.rows = {row.name: row for row in PANELS}
        if len(self.rows) != len(PANELS):
            raise ValueError("two rows of PANELS have one name")
        self.panels: dict[str, Panel] = {name: row.make(selection)
                                         for name, row in self.rows.items()}
        self.docks: dict[str, QDockWidget] = {}
        # The right column reaches down to the status bar, beside the timeline: its tabs (tree,
        # capacity, device; details, text) get the height they need to be read at 1280x720.
        window.setCorner(Qt.BottomRightCorner, RIGHT)
        for name, row in self.rows.items():
            if row.area is None:
                continue
            dock = self.docks[name] = QDockWidget(row.title, window)
            dock.setObjectName(f"dock_{name}")
            dock.setWidget(self.panels[name])
            if row.min_size is not None:
                dock.widget().setMinimumSize(*row.min_size)
            if row.shortcut is not None:
                dock.toggleViewAction().setShortcut(QKeySequence(row.shortcut))
                window.addAction(dock.toggleViewAction())
            if row.on_demand:  # opened by the user: on top, focused, readable
                dock.toggleViewAction().triggered.connect(
                    lambda shown, d=dock: shown and open_tool(window, d))

    def view_actions(self) -> list[QAction | None]:
        """The View menu (a check shows a dock): the docks as the user meets them, a tab group
        together at its first dock's place, then (after a separator: None) the tools."""
        names = [name for name in self.docks if not self.rows[name].on_demand]
        place: dict[str, int] = {}
        for i, name in enumerate(names):
            place.setdefault(self.rows[name].tab_group or name, i)
        names.sort(key=lambda name: place[self.rows[name].tab_group or name])
        tools = [name for name in self.docks if self.rows[name].on_demand]
        return ([self.docks[name].toggleViewAction() for name in names] + [None] +
                [self.docks[name].toggleViewAction() for name in tools])

    def step_aside(self, name: str):
        """A tool window hides while the window shows what it asked for (tool_windows.py);
        returns what brings it back."""
        return step_aside(self.window, self.docks[name], self.rows[name].shortcut)

    def place(self) -> None:
        """The default layout: requests left, tree and details right, timeline below; each tab
        group tabbed in PANELS order, its first dock on top."""
        w, groups = self.window, {}
        for name, dock in self.docks.items():
            row = self.rows[name]
            dock.setFloating(False)
            group = groups.setdefault(row.tab_group, []) if row.tab_group else []
            # Hidden ones never stack up the window, and a dock tabbed onto another is shown once
            # every group is made: shown before, the window came up taller than asked at
            # 1280x720 and left a stale tab bar on screen.
            dock.setVisible(not row.on_demand and not group)
            w.addDockWidget(row.area, dock)
            group.append(name)
        for group in groups.values():
            for under, name in zip(group, group[1:], strict=False):
                w.tabifyDockWidget(self.docks[under], self.docks[name])
        for group in groups.values():
            for name in group[1:]:
                self.docks[name].setVisible(not self.rows[name].on_demand)
        for group in groups.values():
            self.docks[group[0]].raise_()
        self._renew_tab_bars()

    def _renew_tab_bars(self) -> None:
        """Qt 6.11 leaves a stray copy of a dock tab bar on screen when a second group of
        docks is tabified (a "Prefix tree | Capacity" bar over the requests, cut to "P" when
        covered), deleted only once the event loop runs: the first paint or a screenshot
        taken before shows it. restoreState() builds the bars without strays: hide them all and
        restore the layout just made. Tab titles stay whole (scroll buttons, never "P…")."""
        w = self.window
        for bar in w.findChildren(QTabBar, options=Qt.FindDirectChildrenOnly):
            bar.hide()
        w.restoreState(w.saveState())
        for bar in w.findChildren(QTabBar, options=Qt.FindDirectChildrenOnly):
            bar.setElideMode(Qt.ElideNone)
            bar.setUsesScrollButtons(True)

    def default_sizes(self) -> None:
        """Dock sizes as shares of the window, so a small window gets a usable layout too."""
        w, d = self.window, self.docks
        width, height = w.width(), w.height()
        w.resizeDocks([d["requests"], d["tree"]], [int(width * 0.33), int(width * 0.27)],
                      Qt.Horizontal)
        w.resizeDocks([d["timeline"]], [int(height * 0.3)], Qt.Vertical)
        # the right column's halves: the tree, and Details / Text (a prompt needs lines)
        w.resizeDocks([d["tree"], d["details"]], [height // 2, height // 2], Qt.Vertical)
        w.resizeDocks([d["requests"], d["composer"]],
                      [int(height * 0.4), self._composer_height()], Qt.Vertical)

    def _composer_height(self) -> int:
        return max(self.rows["composer"].min_size[1], self.panels["composer"].needed_height())

    def fit_composer(self) -> None:
        """Chat mode shows the transcript: grow the Prompt dock to show every field and the
        transcript's last exchange (taking the height from the requests above, as far as they
        can give), never shrink it."""
        w, dock, above = self.window, self.docks["composer"], self.docks["requests"]
        have, need = dock.height(), dock.height() - dock.widget().height() + self._composer_height()
        if (dock.isVisible() and not dock.isFloating() and have < need
                and w.dockWidgetArea(above) == w.dockWidgetArea(dock)):
            w.resizeDocks([above, dock], [above.height() - (need - have), need], Qt.Vertical)

    def reset(self) -> None:
        """View → Reset layout: the default layout, in a window that fits its screen."""
        size = self.window.size()  # re-adding the docks stacks them for a moment: it would grow
        self.place()
        self.fit(size)
        self.default_sizes()

    def fit(self, size: QSize) -> None:
        """The window at `size`, or less where its screen's free area (frame included) is
        smaller, moved wholly onto it. Before it is first shown: on the screen under the mouse,
        where it will open, centred."""
        w = self.window
        shown = w.isVisible()
        screen = w.screen() if shown else QGuiApplication.screenAt(QCursor.pos()) or w.screen()
        area = screen.availableGeometry()
        # the frame: known once shown; room for a title bar as Qt's restoreGeometry() reckons it
        frame = QSize(2 * BORDER, BORDER + w.style().pixelMetric(QStyle.PM_TitleBarHeight))
        if shown:
            frame = frame.expandedTo(w.frameGeometry().size() - w.size())
        w.resize(size.boundedTo(area.size() - frame))
        outer = QRect(w.frameGeometry().topLeft(), w.size() + frame)
        if not shown:
            outer.moveCenter(area.center())
        outer.moveRight(min(outer.right(), area.right()))
        outer.moveBottom(min(outer.bottom(), area.bottom()))
        w.move(max(outer.left(), area.left()), max(outer.top(), area.top()))

    def restore(self, settings: QSettings) -> None:
        """The layout saved when the window last closed, if it fits a screen now (the default
        one, fitted to the screen, if not: one saved on a larger screen, or widened past it)."""
        w = self.window
        frame = settings.value("frame")
        screen = QGuiApplication.screenAt(frame.center()) if isinstance(frame, QRect) else None
        fits = screen is not None and screen.availableGeometry().contains(frame)
        if not (fits and w.restoreGeometry(settings.value("geometry"))
                and w.restoreState(settings.value("window_state"))):
            self.fit(FIRST_SIZE)
            self.default_sizes()
        self._renew_tab_bars()

    def save(self, settings: QSettings) -> None:
        settings.setValue("geometry", self.window.saveGeometry())
        settings.setValue("window_state", self.window.saveState())
        settings.setValue("frame", self.window.frameGeometry())
