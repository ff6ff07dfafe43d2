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
    save_shot(w, "demo", size, "main_window.png")


def save_shot(w, name: str, size: tuple[int, int], readme_image: str) -> None:
    """The window as an artifact; at 1600x1000 with KVSCOPE_UPDATE_SCREENSHOTS=1 also as the
    README's image in docs/. Closes the window."""
    ARTIFACTS.mkdir(exist_ok=True)
    shot = w.grab().toImage()
    assert shot.save(str(ARTIFACTS / f"{name}_{size[0]}x{size[1]}.png"))
    if size == (1600, 1000) and os.environ.get("KVSCOPE_UPDATE_SCREENSHOTS") == "1":
        assert shot.save(str(Path(__file__).resolve().parents[2] / "docs" / readme_image))
    w.close()


@pytest.mark.parametrize("size", [(1280, 720), (1600, 1000)])
def test_the_hybrid_demo_mid_run_marks_the_window_group_and_its_released_blocks(
        qtbot, tmp_path, size):
    """demo-hybrid playing long_context.jsonl, paused while a document is read: the window
    group's blocks carry the white corner (cached ones too: released out of the window while
    the request runs), full attention's none; the running request's block tables show both
    groups, the window's with nulls. Saved as artifacts; at 1600x1000 with
    KVSCOPE_UPDATE_SCREENSHOTS=1 also as docs/hybrid_window.png."""
    from test_pool_groups import CORNER, WHITE

    w = open_window(qtbot, tmp_path)
    w.resize(*size)
    w.reset_layout()
    w.blocks_box.setValue(512)
    w.load_model("demo-hybrid")
    qtbot.waitUntil(lambda: w.model_name == "demo-hybrid" and not w.engine_client.loading,
                    timeout=30_000)
    w.pace_box.setValue(40)
    w.setFocus()
    qtbot.keyClick(w, Qt.Key_F5)

    def reading() -> bool:  # a request decoding past its window, blocks of both groups held
        s = w.snapshot
        return (s is not None and len(s.groups) == 2 and len(s.more_tables[0]) >= 2
                and any((t == -1).sum() >= 20 for t in s.more_tables[0].values()))

    qtbot.waitUntil(reading, timeout=60_000)
    w.pause()
    qtbot.waitUntil(lambda: not w.running, timeout=10_000)
    qtbot.wait(300)
    snap = w.snapshot
    rid = max(r for r, t in snap.more_tables[0].items() if (t == -1).any())
    w.selection.select_request(rid)
    qtbot.wait(100)

    image = grab_pool(w.pool)
    window_cached = np.flatnonzero((snap.state == CACHED) & (snap.block_group == 1))
    full_held = np.flatnonzero((snap.ref_count > 0) & (snap.block_group == 0))
    assert len(window_cached) >= 20 and len(full_held) >= 50
    for b in window_cached[:5]:
        assert np.abs(np.subtract(cell_pixel(w.pool, image, int(b), *CORNER), WHITE)).max() < 8
    for b in full_held[:5]:
        assert np.abs(np.subtract(cell_pixel(w.pool, image, int(b), *CORNER), WHITE)).max() > 60
    text = w.requests.block_table.toPlainText()
    assert "full attention" in text and "sliding window 128" in text and "∅" in text
    save_shot(w, "demo_hybrid", size, "hybrid_window.png")
