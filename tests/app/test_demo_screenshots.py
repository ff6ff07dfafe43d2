"""The window mid-demo, once evictions have started, at 1280x720 and 1600x1000: checked for
meaning (pool cells in distinguishable colours, five request rows, every toolbar action shown,
the timeline following). Saved as artifacts; at 1600x1000 with KVSCOPE_UPDATE_SCREENSHOTS=1
also as the README image."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from pixels import cell_pixel, grab_pool
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QToolBar
from window_testutil import open_window

from kvscope.engine.snapshot import ACTIVE, CACHED, SHARED

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


@pytest.mark.parametrize("size", [(1280, 720), (1600, 1000)])
def test_the_demo_mid_run_reads_at_a_glance(qtbot, tmp_path, size):
    w = open_window(qtbot, tmp_path)
    w.resize(*size)
    w.reset_layout()
    w.pace_box.setValue(40)  # fast, yet paused close to the frame the wait saw
    w.setFocus()
    qtbot.keyClick(w, Qt.Key_F5)  # the demo on a 256-block pool: evictions come early
    qtbot.waitUntil(lambda: w.snapshot is not None and w.snapshot.num_evicted_blocks > 0
                    and w.snapshot.num_active_blocks > 0  # mid-run, not between arrivals
                    and len(w.requests.model.rows) >= 6, timeout=120_000)
    w.pause()
    qtbot.waitUntil(lambda: not w.running, timeout=10_000)
    qtbot.wait(300)  # the last frame drawn
    snap = w.snapshot

    # Pool: every state present is drawn in its own colour, far from the others'.
    image = grab_pool(w.pool)
    colours = {}
    for state in (ACTIVE, SHARED, CACHED):
        blocks = np.flatnonzero(snap.state == state)
        if len(blocks):
            colours[state] = np.array(cell_pixel(w.pool, image, int(blocks[0])), dtype=float)
    assert len(colours) >= 2, snap.state
    for a in colours:
        for b in colours:
            if a < b:
                assert np.abs(colours[a] - colours[b]).max() > 60, (a, b, colours)
    assert w.pool._gaps_key is not None or w.pool.plot.plotItem.vb.width() / w.pool.cols < 4

    # Requests: at least five rows fully shown.
    table = w.requests.table
    shown = [r for r in range(len(w.requests.model.rows))
             if table.rowViewportPosition(r) >= 0 and table.rowViewportPosition(r)
             + table.rowHeight(r) <= table.viewport().height()]
    assert len(shown) >= 5, (len(shown), table.viewport().height())

    # Toolbar: every action on screen, none in the overflow.
    for tb in w.findChildren(QToolBar):
        for action in tb.actions():
            widget = tb.widgetForAction(action)
            if widget is not None and action.isVisible():
                assert widget.isVisible() and tb.rect().contains(widget.geometry()), \
                    action.text() or widget

    # Timeline: following, the newest step in view.
    t = w.timeline
    assert t.following and not t.follow_button.isVisible()
    qtbot.waitUntil(lambda: t.time_plot.vb.viewRange()[0][1] >= t.data["step"][-1] - 0.5)

    assert w.size().width() == size[0] and w.size().height() == size[1]
    ARTIFACTS.mkdir(exist_ok=True)
    shot = w.grab().toImage()
    assert shot.save(str(ARTIFACTS / f"demo_{size[0]}x{size[1]}.png"))
    if size == (1600, 1000) and os.environ.get("KVSCOPE_UPDATE_SCREENSHOTS") == "1":
        assert shot.save(str(Path(__file__).resolve().parents[2] / "docs" / "main_window.png"))
    w.close()
