"""The side panels read whole in a small window (1280x720) and a large one (1600x1000): one tab
bar per group of tabbed docks with whole titles, a pool title that fits, a prefix tree that
draws while the engine runs with its roots named and no label cut at an edge, a capacity table
with all its rows and a chart whose legend covers nothing, and answers shown whole. Each is
driven through the window as a user would, and checked on what is drawn."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import open_window
from image_compare import ARTIFACTS, to_array
from PySide6.QtCore import QPoint, QPointF, QRectF, QSettings, Qt
from PySide6.QtGui import QTextDocument
from PySide6.QtWidgets import QTabBar

from kvscope.app.frames import Frame, RequestRow
from kvscope.app.main_window import MainWindow
from kvscope.app.panels.capacity_panel import PLOT_MIN_HEIGHT
from kvscope.app.panels.prefix_tree_panel import PrefixTreePanel
from kvscope.engine import KVCacheManager
from kvscope.engine.metrics import StepRecord

SMALL, LARGE = (1280, 720), (1600, 1000)


def bare_window(qtbot, tmp_path, size, reset: bool = True) -> MainWindow:
    """The window without an engine (frames are fed by hand), at a size, in the default layout
    made for that size (reset: as Reset layout makes it; else as a first start makes it)."""
    w = MainWindow(settings=QSettings(str(tmp_path / "k.ini"), QSettings.IniFormat))
    qtbot.addWidget(w)
    w.frame_timer.stop()
    w.resize(*size)
    w.show()
    qtbot.waitExposed(w)
    if reset:
        w.reset_layout()
        qtbot.wait(20)
    return w


def shown_tab_bars(w) -> list[QTabBar]:
    return [bar for bar in w.findChildren(QTabBar, options=Qt.FindDirectChildrenOnly)
            if bar.isVisible()]


def click_tab(qtbot, w, title: str) -> None:
    (bar,) = [b for b in shown_tab_bars(w) if title in [b.tabText(i) for i in range(b.count())]]
    i = [bar.tabText(j) for j in range(bar.count())].index(title)
    qtbot.mouseClick(bar, Qt.LeftButton, pos=bar.tabRect(i).center())


@pytest.mark.parametrize("size", [SMALL, LARGE])
def test_tabbed_docks_show_one_tab_bar_each_with_whole_titles(qtbot, tmp_path, size):
    # As the window first paints: Qt 6.11 deletes its stray copy of a tab bar only later, once
    # the event loop runs (a screenshot taken before, or a slow start, shows it).
    w = bare_window(qtbot, tmp_path, size, reset=False)
    bars = shown_tab_bars(w)
    groups = sorted(tuple(b.tabText(i) for i in range(b.count())) for b in bars)
    assert groups == [("Prefix tree", "Capacity", "Device"), ("Timeline", "Events")]  # no stray
    for bar in bars:
        assert w.rect().contains(bar.geometry())
        for i in range(bar.count()):
            text = bar.tabText(i)
            assert bar.tabRect(i).width() >= bar.fontMetrics().horizontalAdvance(text), text
            assert bar.rect().contains(bar.tabRect(i)), text  # not scrolled out of sight
    # Again after the user resets the layout (the docks are placed anew while shown).
    w.act_reset_layout.trigger()
    qtbot.wait(20)
    assert len(shown_tab_bars(w)) == 2
    click_tab(qtbot, w, "Capacity")
    qtbot.waitUntil(lambda: not w.docks["capacity"].visibleRegion().isEmpty())
    assert w.docks["tree"].visibleRegion().isEmpty()


def pool_of(num_blocks: int) -> KVCacheManager:
    mgr = KVCacheManager(num_blocks, 16)
    for rid in range(6):
        mgr.admit(rid, list(range(100)) + list(range(1000 * rid, 1000 * rid + 300)))
    return mgr


@pytest.mark.parametrize("size", [SMALL, LARGE])
def test_the_pool_title_fits_its_width(qtbot, tmp_path, size):
    w = bare_window(qtbot, tmp_path, size)
    w.show_frame(Frame(snapshot=pool_of(2048).snapshot(), evicted=np.arange(120)))
    qtbot.wait(20)
    title = w.pool.title
    doc = QTextDocument()
    doc.setDefaultFont(title.font())
    doc.setDocumentMargin(0)
    doc.setHtml(title.text())
    assert doc.idealWidth() <= title.contentsRect().width(), title.text()
    assert doc.size().height() <= title.contentsRect().height() + 1  # every line shown
    assert "120 evicted" in title.text() and "2048 blocks" in title.text()
    assert w.width() == size[0]  # the title never widens the window


def labels_inside(panel: PrefixTreePanel) -> list[str]:
    """The labels shown, each checked to lie wholly inside the tree's view."""
    view = panel.vb.sceneBoundingRect().adjusted(-0.5, -0.5, 0.5, 0.5)
    shown = [label for label in panel.labels if label.isVisible()]
    for label in shown:
        assert view.contains(label.sceneBoundingRect()), (label.toPlainText(),
                                                          label.sceneBoundingRect(), view)
    return [label.toPlainText() for label in shown]