"""A KV format picked in the toolbar's kv box with the keyboard and applied (Apply): the pool's
hover and Details say each block's format and bytes, the Capacity panel preselects the format,
live and in the replay of the recorded run; an old session's blocks are the model's dtype.
Screenshots under /tmp/win-kv-format-shots/."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from PySide6.QtCore import QPointF, Qt
from PySide6.QtWidgets import QToolBar
from window_testutil import LOAD_TIMEOUT_MS, open_window

from kvscope.engine.config import KV_CACHE_DTYPES
from kvscope.engine.snapshot import STATE_NAMES

SHOTS = Path("/tmp/win-kv-format-shots")
# The demo model: 4 layers, 4 KV heads, head_dim 32; blocks of 16 tokens. int4 per token and
# head: 2 (K, V) x 4 heads x 32 / 2 B of values + 2 x 4 heads x a float32 scale, per layer:
DATA = 4 * 16 * (2 * 4 * 32 // 2)  # 8,192 B a block
SCALES = 4 * 16 * (2 * 4 * 4)  # 2,048 B a block
INT4 = "int4_per_token_head · 10 KiB (data 8 KiB + scales 2 KiB)"
assert DATA + SCALES == 10 * 1024 and (DATA, SCALES) == (8 * 1024, 2 * 1024)


def hover_block(w, qtbot, block: int) -> str:
    pool = w.pool
    x, y = pool.cell_center(block)
    at = pool.plot.mapFromScene(pool.plot.plotItem.vb.mapViewToScene(QPointF(x, y)))
    qtbot.wait(20)  # (pyqtgraph drops mouse moves less than 10 ms apart)
    qtbot.mouseMove(pool.plot.viewport(), at)
    qtbot.waitUntil(lambda: pool.hover_label.text().startswith(f"block {block} ·"))
    return pool.hover_label.text()


def active_block(w) -> int:
    blocks = [int(b) for t in w.snapshot.block_tables.values() for b in t]
    assert blocks, ("no request holds a block", w.snapshot.step, w.snapshot.num_active_blocks,
                    w.snapshot.block_tables, w.running)
    return blocks[0]


def test_a_format_picked_in_the_kv_box_shows_in_the_pool_details_and_capacity(qtbot, tmp_path):
    w = open_window(qtbot, tmp_path)
    w.resize(1280, 720)
    w.reset_layout()
    assert w.engine.kv_format == "float32"  # auto on the CPU: the model's dtype

    # The keyboard picks int4_per_token_head in the kv box; a click on Apply loads it.
    w.kv_box.setFocus()
    for _ in range(KV_CACHE_DTYPES.index("int4_per_token_head") - w.kv_box.currentIndex()):
        qtbot.keyClick(w.kv_box, Qt.Key_Down)
    assert w.kv_box.currentText() == "int4_per_token_head"
    apply = w.findChild(QToolBar, "toolbar_main").widgetForAction(w.act_apply)
    assert apply.isVisible()
    qtbot.mouseClick(apply, Qt.LeftButton)
    qtbot.waitUntil(lambda: w.engine is not None and w.engine.kv_format == "int4_per_token_head",
                    timeout=LOAD_TIMEOUT_MS)
    path = tmp_path / "int4.kvscope"
    w.start_recording(str(path))
    qtbot.waitUntil(lambda: w.recording_path == str(path), timeout=5000)

    # F5 runs the demo a few steps, slowly: the pause lands while requests still hold blocks
    # even on a loaded machine
    w.pace_box.setValue(3)
    qtbot.keyClick(w, Qt.Key_F5)
    qtbot.waitUntil(lambda: w.snapshot is not None and w.snapshot.step >= 3
                    and w.snapshot.num_active_blocks > 0, timeout=30_000)
    qtbot.keyClick(w, Qt.Key_Space)
    qtbot.waitUntil(lambda: not w.running, timeout=10_000)
    qtbot.wait(200)  # the last frame drawn

    last, block = w.snapshot.step, active_block(w)
    text = hover_block(w, qtbot, block)
    snap = w.snapshot
    state = f"{STATE_NAMES[snap.state[block]]} · ref {snap.ref_count[block]}"
    # the hover's one line: the format and the block's bytes, then owners and tokens
    assert text.startswith(f"block {block} · {state} · int4_per_token_head · 10 KiB · owners"), \
        text
    qtbot.mouseClick(w.pool.plot.viewport(), Qt.LeftButton, pos=w.pool.plot.mapFromScene(
        w.pool.plot.plotItem.vb.mapViewToScene(QPointF(*w.pool.cell_center(block)))))
    qtbot.waitUntil(lambda: f"Block {block}" in w.details.text.toPlainText())
    assert INT4 in w.details.text.toPlainText()  # and, in Details, what the bytes hold

    cap = w.capacity
    assert cap.dtype_box.currentText() == "int4_per_token_head"
    assert "engine cache int4_per_token_head" in cap.source_label.text()
    assert cap.bytes_per_token_label.text() == f"{(DATA + SCALES) // 16:,} B = 640 B"
    SHOTS.mkdir(exist_ok=True)
    assert w.grab().toImage().save(str(SHOTS / "int4_live_1280x720.png"))
    w.docks["capacity"].raise_()
    qtbot.wait(50)
    assert w.grab().toImage().save(str(SHOTS / "int4_capacity_1280x720.png"))

    # The replay: the session's format, its bytes (the shape, and so the parts, not recorded).
    w.toggle_recording()
    qtbot.waitUntil(lambda: w.recording_path is None, timeout=5000)
    assert w.open_session(str(path))
    w.resize(1600, 1000)
    qtbot.wait(100)
    assert w.kv_box.currentText() == "int4_per_token_head" and not w.kv_box.isEnabled()
    w.replay_bar.set_step(last)
    block = active_block(w)
    text = hover_block(w, qtbot, block)
    assert "· int4_per_token_head · 10 KiB ·" in text, text
    assert w.grab().toImage().save(str(SHOTS / "int4_replay_1600x1000.png"))
    w.leave_replay()

    # A session from before the formats: no kv_cache_dtype in its engine config; its blocks
    # are the model's dtype (float32 on the CPU), their bytes not known.
    with sqlite3.connect(path) as db:
        db.execute("UPDATE session SET engine_config = '{}', kv_bytes_per_token = NULL")
    assert w.open_session(str(path))
    w.replay_bar.set_step(last)
    text = hover_block(w, qtbot, active_block(w))
    assert " · float32 · owners" in text and "KiB" not in text, text
    w.close()
