"""An attached fleet in the window: one row per instance above the pool; selecting a row (click,
↑ ↓) shows that instance's slots in the pool, tree and status; a click on a cell says which
instances hold its block hash, in Details and in the table; a restart is its instance's alone."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from PySide6.QtCore import QPointF, Qt
from window_testutil import bare_window, tree_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sessions"))
from kv_fake_publisher import batch, stored  # noqa: E402

from kvscope.sessions.kv_events.fleet import Instance  # noqa: E402

SHOTS = Path(__file__).resolve().parents[1] / "artifacts"  # tests/artifacts (ignored)


def click_row(qtbot, table, row):
    rect = table.visualRect(table.model().index(row, 1))
    qtbot.mouseClick(table.viewport(), Qt.LeftButton, pos=rect.center())


def click_cell(qtbot, pool, slot):
    scene = pool.plot.plotItem.vb.mapViewToScene(QPointF(*pool.cell_center(slot)))
    qtbot.mouseClick(pool.plot.viewport(), Qt.LeftButton, pos=pool.plot.mapFromScene(scene))


def column(table, col):
    return [table.item(r, col).text() for r in range(table.rowCount())]


@pytest.mark.parametrize("size", [(1280, 720), (1600, 1000)])
def test_the_fleet_table_drives_the_pool_tree_and_details(qtbot, tmp_path, fakes, size):
    w = bare_window(qtbot, tmp_path, size)
    names = ["alpha", "beta", "gamma"]
    assert w.attach(fleet=[Instance(n, f.endpoint, f.replay_endpoint)
                           for n, f in zip(names, fakes, strict=True)], slots=256)
    for f in fakes:
        f.wait_subscribed(timeout_s=10)
    a, b, c = fakes
    a.send(0, batch([stored([1, 2, 3], None), stored([4], 3)]))
    b.send(0, batch([stored([1, 2], None), stored([8], None, medium="CPU")]))
    c.send(0, batch([stored([9], None)]))
    table = w.fleet_view.table
    assert table.isVisible() and column(table, 1) == ["all instances", *names]
    qtbot.waitUntil(lambda: column(table, 2) == ["8", "4", "3", "1"], timeout=5000)
    qtbot.waitUntil(lambda: w.snapshot.num_cached_blocks == 7, timeout=3000)
    assert column(table, 0)[1:] == ["●", "●", "●"]
    # the table sits above the pool, all of it readable
    assert table.geometry().bottom() < w.pool.geometry().top()
    assert table.viewport().height() >= 4 * table.verticalHeader().defaultSectionSize()
    # a row picks the instance: pool, tree and status show its slots only
    click_row(qtbot, table, 2)
    qtbot.waitUntil(lambda: w.snapshot.num_cached_blocks == 2, timeout=3000)
    assert w.snapshot.host.num_cached_blocks == 1  # beta's CPU tier
    assert tree_blocks(w) == 2 and "instance beta" in w.status.text()
    qtbot.keyClick(table, Qt.Key_Down)  # the keyboard too: gamma
    qtbot.waitUntil(lambda: w.snapshot.num_cached_blocks == 1, timeout=3000)
    assert tree_blocks(w) == 1
    click_row(qtbot, table, 0)
    qtbot.waitUntil(lambda: w.snapshot.num_cached_blocks == 7, timeout=3000)
    # a click on alpha's block 2: held by alpha and beta, prefix 2 of 2 each; not by gamma
    slot = w.source.session.slots.slot_of[(0, 0, "GPU", 2)]
    click_cell(qtbot, w.pool, slot)
    text = w.details.text.toPlainText()
    assert "instance alpha" in text and "Held by 2 of 3 instances" in text, text
    assert "alpha: GPU · prefix 2/2" in text and "beta: GPU · prefix 2/2" in text
    assert "gamma: not held" in text
    assert table.horizontalHeaderItem(6).text() == "Holds block"
    assert column(table, 6)[1:] == ["GPU · prefix 2/2", "GPU · prefix 2/2", "not held"]
    # the screenshot, with a row picked (alpha)
    click_row(qtbot, table, 1)
    qtbot.waitUntil(lambda: w.snapshot.num_cached_blocks == 4, timeout=3000)
    tree_blocks(w)
    SHOTS.mkdir(exist_ok=True)
    w.grab().save(str(SHOTS / f"fleet_window_{size[0]}x{size[1]}.png"))
    # gamma's publisher restarts (its sequence goes back): gamma's restart only
    with c._lock:
        c.buffer.clear()
    c.send(0, batch([stored([10, 11], None)]))
    qtbot.waitUntil(lambda: column(table, 5) == ["1", "0", "0", "1"], timeout=5000)
    assert column(table, 0)[1:] == ["●", "●", "▲"]
    assert "gamma (1 restarts)" in w.attach_view.health.text()
    qtbot.waitUntil(lambda: column(table, 2)[3] == "2", timeout=3000)
    assert w.snapshot.num_cached_blocks == 4  # alpha's view is untouched
    w.close()
