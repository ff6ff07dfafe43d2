"""The block table of a request of a hybrid model (full attention and a sliding window): one row
per KV-cache group named after it, the window's nulls drawn as "∅" cells that explain themselves
on hover, a finished request's freed blocks per group; and the whole window at 1280x720 and
1600x1000 with a hybrid pool (screenshots kept under /tmp/win-pool-shots/)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hybrid_testutil import hybrid_rows, hybrid_scenario
from pixels import cell_pixel, close, grab_pool
from PySide6.QtCore import QEvent, QPoint, Qt
from PySide6.QtGui import QHelpEvent, QTextDocument
from PySide6.QtWidgets import QApplication, QToolTip
from test_pool_groups import CORNER
from test_requests_reuse import click
from test_side_panels_fit import LARGE, SMALL, laid_out_window
from window_testutil import shown

from kvscope.app.frames import Frame, RequestRow
from kvscope.app.panels.block_table_view import NULL_TIP
from kvscope.app.panels.requests_panel import RequestsPanel

SHOTS = os.environ.get("KVSCOPE_GROUP_SHOTS", "/tmp/win-pool-shots")


@pytest.fixture
def panel(qtbot):
    return shown(qtbot, RequestsPanel(), (700, 500))


def point_at(text_edit, offset: int) -> QPoint:
    """On the character at `offset` of the text (viewport coordinates)."""
    cursor = text_edit.textCursor()
    cursor.setPosition(offset)
    rect = text_edit.cursorRect(cursor)
    return QPoint(rect.right() + 3, rect.center().y())


def hover(text_edit, offset: int) -> str:
    """The tooltip shown on hovering the character at `offset` of the text."""
    pos, viewport = point_at(text_edit, offset), text_edit.viewport()
    QApplication.sendEvent(viewport, QHelpEvent(QEvent.ToolTip, pos, viewport.mapToGlobal(pos)))
    return QToolTip.text() if QToolTip.isVisible() else ""


def test_one_row_per_group_with_the_windows_nulls_drawn(panel, qtbot):
    mgr = hybrid_scenario()
    snap = mgr.snapshot()
    panel.show_frame(Frame(snapshot=snap, requests=hybrid_rows(mgr)))
    click(panel, qtbot, 0)
    full, window = snap.tables_of(0)
    lines = panel.block_table.toPlainText().split("\n")
    assert lines == [
        "full attention: " + " ".join(f"{i}→{b}" for i, b in enumerate(full)),
        "sliding window 8: " + " ".join(f"{i}→∅" if b < 0 else f"{i}→{b}"
                                        for i, b in enumerate(window))]
    nulls = int((window < 0).sum())
    assert nulls == 6
    title = panel.block_table_title.text()
    held = len(full) + len(window) - nulls
    assert title == f"Block tables of #0: {held} blocks, 4 shared, {nulls} released (∅)"
    assert "One row per KV-cache group" in panel.block_table_title.toolTip()
    # a null explains itself on hover; a block does not
    text = panel.block_table.toPlainText()
    table = panel.block_table
    for i in range(nulls):
        assert table.tip_at(point_at(table, text.index(f"{i}→∅"))) == NULL_TIP
    assert hover(table, text.index("5→∅")) == NULL_TIP  # a real tooltip
    for i, b in ((6, window[6]), (0, full[0])):
        assert table.tip_at(point_at(table, text.index(f"{i}→{b}"))) == ""
    # shared blocks in orange as with one group: #1's first 4 full-attention blocks
    click(panel, qtbot, 1)
    qtbot.waitUntil(lambda: panel.block_table_title.text().startswith("Block tables of #1"))
    html = panel.block_table.toHtml()
    assert html.count("#e69f00") == 4 and "2→∅" not in panel.block_table.toPlainText()
    assert panel.block_table.toPlainText().split("\n")[1].startswith("sliding window 8: 0→∅ 1→∅ 2→")


def test_a_finished_hybrid_requests_freed_blocks_per_group(panel, qtbot):
    mgr = hybrid_scenario()
    events = mgr.events.drain()
    mgr.begin_step(5)
    full, window = (list(t) for t in mgr.block_tables(0))
    mgr.free(0)
    events += mgr.events.drain()
    panel.selection.freed.follow(events)
    snap = mgr.snapshot()
    rows = [RequestRow.new(0, "finished: length", 32, output_tokens=3),
            RequestRow.new(1, "prefill", 17, cached_tokens=16)]
    panel.show_frame(Frame(snapshot=snap, requests=rows))
    click(panel, qtbot, 0)
    held = [b for b in full + window if b >= 0]
    title = panel.block_table_title.text()
    assert title.startswith(f"#0 finished: {len(held) - 2} of {len(held)} blocks still in the "
                            "pool")
    assert title.endswith("0 evicted, 2 partial")  # each group's last block
    lines = panel.block_table.toPlainText().split("\n")
    assert lines[0].startswith("full attention: 0→0 1→1")
    assert lines[1] == "sliding window 8: " + " ".join(
        f"{i}→∅" if b < 0 else f"{i}→{b}" + ("·" if i == len(window) - 1 else "")
        for i, b in enumerate(window))
    # the pool outlines what the finished request left, in both groups
    assert sorted(panel.selection.highlighted(snap).tolist()) == sorted(
        b for b in held if snap.block_hash[b])


def hybrid_window(qtbot, tmp_path, size):
    """The window with a hybrid pool of 2048 blocks, request #0 selected in the table."""
    w = laid_out_window(qtbot, tmp_path, size)
    mgr = hybrid_scenario(2048, others=80)
    snap = mgr.snapshot()
    w.show_frame(Frame(snapshot=snap, requests=hybrid_rows(mgr)))
    qtbot.wait(20)
    click(w.requests, qtbot, 0)
    qtbot.waitUntil(lambda: w.requests.block_table_title.text().startswith("Block tables of #0"))
    return w, snap


@pytest.mark.parametrize("size", [SMALL, LARGE])
def test_the_window_shows_a_hybrid_pool_and_block_table(qtbot, tmp_path, size):
    w, snap = hybrid_window(qtbot, tmp_path, size)
    pool = w.pool
    name = f"{size[0]}x{size[1]}"
    os.makedirs(SHOTS, exist_ok=True)
    w.grab().save(f"{SHOTS}/window-{name}.png")
    pool.grab().save(f"{SHOTS}/pool-{name}.png")
    w.docks["requests"].grab().save(f"{SHOTS}/block-table-{name}.png")
    # the title, filter beside it, fits its width with every line shown
    title = pool.title
    doc = QTextDocument()
    doc.setDefaultFont(title.font())
    doc.setDocumentMargin(0)
    doc.setHtml(title.text())
    assert doc.idealWidth() <= title.contentsRect().width(), title.text()
    assert doc.size().height() <= title.contentsRect().height() + 1
    assert pool.group_filter.isVisible() and w.width() == size[0]
    assert "sliding window 8:" in title.text() and "full attention:" in title.text()
    # at 2048 blocks a window block's corner is still white, a full-attention one's is not
    full, window = snap.tables_of(0)
    image = grab_pool(pool)
    assert close(cell_pixel(pool, image, int(window[6]), *CORNER), (255, 255, 255), tol=30)
    assert not close(cell_pixel(pool, image, int(full[5]), *CORNER), (255, 255, 255), 60)
    # the selected request is outlined in both groups, and its table shows both rows
    assert set(pool.highlighted.tolist()) == set(np.concatenate([full, window[window >= 0]]))
    assert "sliding window 8: 0→∅" in w.requests.block_table.toPlainText()
    qtbot.mouseClick(pool.group_filter, Qt.LeftButton)  # the filter opens where it is drawn
    qtbot.waitUntil(pool.group_filter.view().isVisible)
    pool.group_filter.hidePopup()
    pool.group_filter.setCurrentIndex(2)
    pool.grab().save(f"{SHOTS}/pool-{name}-sliding-window-only.png")
