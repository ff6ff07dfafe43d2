"""The host tier in the window: set in the Engine menu and applied with Apply (reload), a
prompt evicted from a small device pool to the host and loaded back from it; the pool's second
grid (pixels, title counts, hover, click), the requests table's split by tier, and the same
split in the replay of the recorded run. Screenshots under /tmp/win-host-shots/."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from pixels import close, grab_pool, lut_rgb
from PySide6.QtCore import QPoint, QPointF, Qt
from PySide6.QtGui import QColor, QImage
from window_testutil import LOAD_TIMEOUT_MS, open_window

from kvscope.app import palette
from kvscope.app.panels.requests_panel import BAR, HOST_HATCH, REUSED_COLOR
from kvscope.engine.config import SamplingParams
from kvscope.engine.snapshot import CACHED

SHOTS = Path("/tmp/win-host-shots")
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
A = "You are a careful assistant for people who learn Python. " * 2  # 3 full blocks
B = "Lists and tuples and dictionaries are containers of values. " * 15  # 15 blocks: evicts A
HOST_BLOCKS = 64


def run_offload(w, qtbot, path) -> None:
    """A 16-block pool with a host tier of 64 blocks set through the Engine menu, recorded:
    A, then B (evicts A's blocks: offloaded), then A again (its prefix loaded back)."""
    w.blocks_box.setValue(16)
    w.host_blocks_box.setValue(HOST_BLOCKS)
    w.act_apply.trigger()
    qtbot.waitUntil(lambda: w.engine is not None and w.engine.num_blocks == 16
                    and w.snapshot is not None and w.snapshot.host is not None,
                    timeout=LOAD_TIMEOUT_MS)
    w.start_recording(str(path))
    qtbot.waitUntil(lambda: w.recording_path == str(path), timeout=5000)
    for i, prompt in enumerate((A, B, A + "Tell me more.")):
        w.submit(prompt, PARAMS, None)
        qtbot.waitUntil(lambda n=i + 1: len(w.requests.model.rows) == n and all(
            r.state.startswith("finished") for r in w.requests.model.rows), timeout=30_000)
    w.pause()
    qtbot.waitUntil(lambda: not w.running, timeout=10_000)
    qtbot.wait(200)  # the last frame drawn


def host_point(pool, block: int, dx: float = 0.0) -> QPoint:
    x, y = pool.host_grid.cell_center(block)
    return pool.plot.mapFromScene(pool.plot.plotItem.vb.mapViewToScene(QPointF(x + dx, y)))


def pixel(pool, image: QImage, at: QPoint) -> tuple[int, int, int]:
    ratio = image.devicePixelRatio()
    c = image.pixelColor(int(at.x() * ratio), int(at.y() * ratio))
    return c.red(), c.green(), c.blue()


def hover(w, qtbot, at: QPoint, starts: str) -> str:
    qtbot.wait(20)  # (pyqtgraph drops mouse moves less than 10 ms apart)
    qtbot.mouseMove(w.pool.plot.viewport(), at)
    qtbot.waitUntil(lambda: w.pool.hover_label.text().startswith(starts))
    return w.pool.hover_label.text()


def test_the_host_tier_is_drawn_counted_described_and_split_in_the_requests(qtbot, tmp_path):
    w = open_window(qtbot, tmp_path)
    w.resize(1280, 720)
    w.reset_layout()
    run_offload(w, qtbot, tmp_path / "host.kvscope")
    snap, pool = w.snapshot, w.pool
    host = snap.host
    assert host.num_blocks == HOST_BLOCKS and host.num_cached_blocks > 0

    # Pixels: each cached host cell in its cached shade (darker = evicted sooner).
    image = grab_pool(pool)
    codes = palette.display_codes(host)
    lut = palette.make_lut()
    cached = np.flatnonzero(host.state == CACHED)
    for b in cached:
        got = pixel(pool, image, host_point(pool, int(b)))
        assert close(got, lut_rgb(int(codes[b]), lut)), (b, got)
        assert got[1] > got[0] + 40 and got[1] > got[2]  # green
    free = np.flatnonzero(host.state == 0)
    assert close(pixel(pool, image, host_point(pool, int(free[-1]))), (0xEE, 0xEE, 0xEE))

    # The title counts the host tier as the snapshot does.
    title = re.sub("<[^>]+>", "", pool.title.text())
    assert (f"Host tier · {HOST_BLOCKS} blocks: {host.num_cached_blocks} cached · "
            f"{host.num_free_blocks} free") in title, title

    # Hover: a host block whose hash is back on the device, one only on the host, and a
    # device block with a copy on the host.
    on_device = {int(h): b for b, h in enumerate(snap.block_hash.tolist()) if h}
    both = [int(b) for b in cached if int(host.block_hash[b]) in on_device]
    only = [int(b) for b in cached if int(host.block_hash[b]) not in on_device]
    assert both and only, (both, only)
    h, d = both[0], on_device[int(host.block_hash[both[0]])]
    text = hover(w, qtbot, host_point(pool, h), f"host block {h} · cached")
    assert f"hash {int(host.block_hash[h]):016x}"[:19] in text
    assert f"also on the device as block {d}" in text, text
    text = hover(w, qtbot, host_point(pool, only[0]), f"host block {only[0]} · cached")
    assert "only on the host" in text, text
    x, y = pool.cell_center(d)
    at = pool.plot.mapFromScene(pool.plot.plotItem.vb.mapViewToScene(QPointF(x, y)))
    text = hover(w, qtbot, at, f"block {d} ·")
    assert f"also on the host as block {h}" in text, text

    # Click: the host block is selected (outlined) and described.
    qtbot.mouseClick(pool.plot.viewport(), Qt.LeftButton, pos=host_point(pool, h))
    qtbot.waitUntil(lambda: w.selection.host_blocks == (h,))
    assert w.selection.blocks == () and w.selection.request is None
    assert f"Host block {h}" in w.details.text.toPlainText()
    assert f"also on the device as block {d}" in w.details.text.toPlainText()
    image = grab_pool(pool)
    assert max(pixel(pool, image, host_point(pool, h, dx=0.41))) < 60  # a dark outline
    assert max(pixel(pool, image, host_point(pool, only[0], dx=0.41))) > 60

    # Requests: the third request's cached tokens split by tier, in its tooltip and its bar.
    rows = w.requests.model.rows
    third = rows[2]
    assert 0 < third.host_cached_tokens < third.cached_tokens, third
    assert [r.host_cached_tokens for r in rows[:2]] == [0, 0]
    index = w.requests.model.index(2, BAR)
    tip = w.requests.model.data(index, Qt.ToolTipRole)
    device = third.cached_tokens - third.host_cached_tokens
    assert (f"{device} tokens from the device, {third.host_cached_tokens} loaded back from the "
            "host tier") in tip, tip
    assert "host" not in w.requests.model.data(w.requests.model.index(0, BAR), Qt.ToolTipRole)
    table = w.requests.table
    rect = table.visualRect(index)
    shot = table.viewport().grab().toImage()
    y = rect.center().y() - 3  # above the number's glyphs
    hatch, plain = QColor(HOST_HATCH), QColor(REUSED_COLOR)
    span = rect.width() - 4
    host_px = round(span * third.host_cached_tokens / third.prompt_tokens)
    cached_px = round(span * third.cached_tokens / third.prompt_tokens)
    host_part = [shot.pixelColor(x, y) for x in range(rect.left() + 2 + cached_px - host_px + 1,
                                                      rect.left() + 2 + cached_px - 1)]
    device_part = [shot.pixelColor(x, y) for x in range(rect.left() + 3,
                                                        rect.left() + cached_px - host_px)]
    assert any(c == hatch for c in host_part) and any(c == plain for c in host_part)
    assert all(c == plain for c in device_part)

    SHOTS.mkdir(exist_ok=True)
    assert w.grab().toImage().save(str(SHOTS / "host_live_1280x720.png"))
    w.close()


def test_a_recorded_run_replays_the_host_tier_and_the_split(qtbot, tmp_path):
    w = open_window(qtbot, tmp_path)
    w.resize(1600, 1000)
    w.reset_layout()
    path = tmp_path / "host.kvscope"
    run_offload(w, qtbot, path)
    live = [(r.request_id, r.cached_tokens, r.host_cached_tokens) for r in w.requests.model.rows]
    assert live[2][2] > 0
    last = w.snapshot.step
    w.toggle_recording()
    qtbot.waitUntil(lambda: w.recording_path is None, timeout=5000)
    w.host_blocks_box.setValue(0)  # the user's setting, back with live
    assert w.open_session(str(path))
    w.replay_bar.set_step(last)
    assert [(r.request_id, r.cached_tokens, r.host_cached_tokens)
            for r in w.requests.model.rows] == live
    # The session's host tier in the Engine menu, read-only; the pool draws its grid.
    assert w.host_blocks_box.value() == HOST_BLOCKS and not w.host_blocks_box.isEnabled()
    assert w.snapshot.host is not None and w.pool.host_grid.rows > 0
    assert "Host tier" in w.pool.title.text()
    SHOTS.mkdir(exist_ok=True)
    assert w.grab().toImage().save(str(SHOTS / "host_replay_1600x1000.png"))
    w.leave_replay()
    assert w.host_blocks_box.value() == 0 and w.host_blocks_box.isEnabled()
    w.close()
