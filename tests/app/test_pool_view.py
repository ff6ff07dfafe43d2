"""The block pool read at a glance: cells 1 px apart, a title with the counts, hover text that
clears on leaving and gives a cached block's token span, evictions as an outline over the
block's new state, and state colours far apart (CIE76 delta-E)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from pixels import cell_pixel, close, grab_pool, lut_rgb
from PySide6.QtCore import QPoint, QPointF, Qt
from test_panel_screenshots import scenario
from window_testutil import beside_a_label

from kvscope.app import palette
from kvscope.app.panels.pool_view import PoolView
from kvscope.engine import KVCacheManager
from kvscope.engine.snapshot import CACHED


def lab(rgb) -> np.ndarray:
    """sRGB (0-255) to CIE L*a*b* (D65)."""
    c = np.asarray(rgb, dtype=np.float64) / 255
    c = np.where(c > 0.04045, ((c + 0.055) / 1.055) ** 2.4, c / 12.92)
    m = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722],
                  [0.0193, 0.1192, 0.9505]])
    xyz = m @ c / np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > (6 / 29) ** 3, np.cbrt(xyz), xyz / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def test_every_state_colour_is_far_from_every_other_state():
    lut = palette.make_lut()
    states = {
        "free": [lut[palette.CODE_FREE, :3]],
        "active": [lut[palette.CODE_ACTIVE, :3]],
        "shared": [lut[palette.CODE_SHARED + i, :3] for i in range(palette.SHARED_SHADES)],
        "cached": [lut[palette.CODE_CACHED + i, :3] for i in range(palette.CACHED_SHADES)],
        "evicted": [palette._rgb(palette.EVICTED_COLOR)],
    }
    assert lab((255, 255, 255))[0] == pytest.approx(100, abs=0.1)  # the conversion is sane
    for a, b in itertools.combinations(states, 2):
        nearest = min(np.linalg.norm(lab(x) - lab(y)) for x in states[a] for y in states[b])
        assert nearest > 20, (a, b, nearest)


@pytest.fixture
def pool(qtbot):
    """A pool view beside another widget (for the mouse to leave to), showing a real manager's
    snapshot with active, shared, cached, free and evicted blocks."""
    mgr = scenario()
    events = mgr.events.drain()
    evicted = [b for e in events if e.kind == "evicted" for b in e.blocks]
    view = PoolView()
    box, other = beside_a_label(qtbot, view, (640, 480))
    snap = mgr.snapshot()
    view.set_snapshot(snap, evicted)
    view.other = other
    yield view, snap, evicted
    box.close()


def screen_point(view, x: float, y: float) -> QPoint:
    scene = view.plot.plotItem.vb.mapViewToScene(QPointF(x, y))
    return view.plot.mapFromScene(scene)


def test_cells_are_one_pixel_apart_when_large_enough(pool, qtbot):
    view, snap, _ = pool
    view.highlight(None)
    image = grab_pool(view)
    (x0, x1), _ = view.plot.plotItem.vb.viewRange()
    px = (x1 - x0) / view.plot.plotItem.vb.width()  # a pixel, in cells
    assert px < 1 / 4
    lut = palette.make_lut()
    for b in (1, 2, view.cols + 3):  # neighbours in a row and in a column
        assert close(cell_pixel(view, image, b), lut_rgb(int(view.codes[b]), lut))
        for right in (True, False):  # the boundary with the next cell, within a pixel
            near = [cell_pixel(view, image, b, dx=0.5 + k * px if right else 0,
                               dy=0 if right else 0.5 + k * px) for k in (-1, -0.5, 0, 0.5, 1)]
            assert any(close(c, (255, 255, 255), tol=2) for c in near), (b, near)
    # A pool of tiny cells (under 4 px) has no gaps: they would hide the cells.
    big = KVCacheManager(20000, 16).snapshot()
    view.set_snapshot(big)
    x, _ = view.gaps.getData()
    assert x is None or len(x) == 0
    view.set_snapshot(snap)
    assert len(view.gaps.getData()[0]) > 0


def test_the_title_counts_the_blocks(pool):
    view, snap, evicted = pool
    text = view.title.text()
    assert f"{snap.num_blocks} blocks of {snap.block_size} tokens" in text
    assert f"{snap.num_active_blocks} active ({snap.num_shared_blocks} shared)" in text
    assert f"{snap.num_cached_blocks} cached · {snap.num_free_blocks} free" in text
    assert f"{len(evicted)} evicted this step" in text


def test_hover_shows_a_cached_blocks_token_span_and_clears_on_leaving(pool, qtbot):
    view, snap, _ = pool
    cached = [b for b in range(snap.num_blocks) if snap.state[b] == CACHED]
    assert cached
    # The cached blocks of request 3's prompt: its chain starts with the shared system prompt.
    b = cached[-1]
    qtbot.mouseMove(view.plot.viewport(), screen_point(view, *view.cell_center(b)))
    qtbot.waitUntil(lambda: view.hover_label.text().startswith(f"block {b} · cached"))
    by_hash = {int(h): i for i, h in enumerate(snap.block_hash.tolist()) if h}
    depth, parent = 0, int(snap.parent_hash[b])
    while parent in by_hash:
        depth, parent = depth + 1, int(snap.parent_hash[by_hash[parent]])
    assert depth > 0
    first = depth * snap.block_size
    assert f"tokens {first}–{first + snap.block_size - 1} of its prefix" in view.hover_label.text()
    qtbot.mouseMove(view.other, QPoint(5, 5))
    qtbot.waitUntil(lambda: view.hover_label.text() == "hover a block for details")


def test_an_evicted_block_is_outlined_over_its_new_state(pool):
    view, snap, evicted = pool
    image = grab_pool(view)
    lut = palette.make_lut()
    vermilion = tuple(int(v) for v in palette._rgb(palette.EVICTED_COLOR))
    for b in evicted[:10]:
        inside = cell_pixel(view, image, b)
        assert close(inside, lut_rgb(int(view.codes[b]), lut)), (b, inside)  # its state
        rim = cell_pixel(view, image, b, dx=0.47)
        assert close(rim, vermilion, tol=40), (b, rim)
    assert sorted(view.evicted.tolist()) == sorted(evicted)
    image_before = image
    view.set_snapshot(snap, [])  # the next step: no outline
    b = evicted[0]
    assert not close(cell_pixel(view, grab_pool(view), b, dx=0.47), vermilion, tol=40)
    assert cell_pixel(view, image_before, b) == cell_pixel(view, grab_pool(view), b)


def test_click_on_a_block_selects_it(pool, qtbot):
    view, snap, _ = pool
    b = int(snap.block_tables[0][0])
    qtbot.mouseClick(view.plot.viewport(), Qt.LeftButton,
                     pos=screen_point(view, *view.cell_center(b)))
    assert b in view.highlighted.tolist()
