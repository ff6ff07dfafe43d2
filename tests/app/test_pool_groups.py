"""The pool of a model with two KV-cache groups (full attention and a sliding window), read off
its rendering: a white corner marks the sliding-window group's blocks (held or cached; never a
free block, never a full-attention one), the group filter (mouse or keys) fades the other
group's cells and the title counts the chosen group, hover text and clicks reach the blocks of
every group's tables, and a one-group model brings the plain pool back."""

from __future__ import annotations

import numpy as np
import pytest
from hybrid_testutil import hybrid_scenario
from pixels import cell_pixel, close, grab_pool, lut_rgb
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication
from test_pool_view import screen_point
from window_testutil import beside_a_label

from kvscope.app import palette
from kvscope.app.frames import Frame
from kvscope.app.panels.details import DetailsPanel
from kvscope.app.panels.pool_view import PoolView
from kvscope.engine import KVCacheManager
from kvscope.engine.snapshot import ACTIVE, CACHED, FREE, SHARED

WHITE = (255, 255, 255)
CORNER = (-0.33, -0.33)  # well inside the top-left triangle (5/8 of a cell on each side)
FADE_ALPHA = 200 / 255


@pytest.fixture
def hybrid(qtbot):
    mgr = hybrid_scenario()
    view = PoolView()
    details = DetailsPanel(view.selection)
    box, other = beside_a_label(qtbot, view, (900, 600))
    snap = mgr.snapshot()
    for panel in (view, details):
        panel.show_frame(Frame(snapshot=snap))
    full, window = snap.tables_of(0)
    yield view, details, mgr, snap, int(full[5]), int(window[6])
    box.close()


def counts(snap, group: int) -> tuple[int, int, int]:
    """(active, shared, cached) blocks that `group` last allocated, from the snapshot."""
    mine = snap.block_group == group
    return (int((mine & ((snap.state == ACTIVE) | (snap.state == SHARED))).sum()),
            int((mine & (snap.state == SHARED)).sum()), int((mine & (snap.state == CACHED)).sum()))


def faded(rgb) -> tuple[int, ...]:
    return tuple(int(round(c * (1 - FADE_ALPHA) + 255 * FADE_ALPHA)) for c in rgb)


def test_a_white_corner_marks_the_sliding_window_groups_blocks_only(hybrid):
    view, _, mgr, snap, full_block, window_block = hybrid
    image, lut = grab_pool(view), palette.make_lut()
    active = lut_rgb(palette.CODE_ACTIVE, lut)
    for b in (full_block, window_block):  # both active, one owner: the same state colour
        assert close(cell_pixel(view, image, b), active)
    assert close(cell_pixel(view, image, window_block, *CORNER), WHITE)
    assert close(cell_pixel(view, image, full_block, *CORNER), active)
    # the blocks that left #0's window are cached, and keep their mark
    released = np.flatnonzero((snap.state == CACHED) & (snap.block_group == 1))
    assert len(released) >= 4
    for b in released:
        assert close(cell_pixel(view, image, int(b), *CORNER), WHITE), b
        assert not close(cell_pixel(view, image, int(b)), WHITE)
    # a reset drops every cached hash: those blocks are free, of no group, unmarked
    mgr.reset_prefix_cache()
    view.set_snapshot(after := mgr.snapshot())
    assert all(after.state[released] == FREE) and all(after.block_group[released] == 1)
    image = grab_pool(view)
    free = lut_rgb(palette.CODE_FREE, lut)
    for b in released:
        assert close(cell_pixel(view, image, int(b), *CORNER), free), b
    assert close(cell_pixel(view, image, window_block, *CORNER), WHITE)  # still held


def choose_by_mouse(qtbot, combo, text: str) -> None:
    qtbot.mouseClick(combo, Qt.LeftButton)
    popup = combo.view()
    qtbot.waitUntil(popup.isVisible)
    qtbot.wait(QApplication.doubleClickInterval() + 50)  # a release sooner is ignored (Qt)
    row = [combo.itemText(i) for i in range(combo.count())].index(text)
    qtbot.mouseClick(popup.viewport(), Qt.LeftButton,
                     pos=popup.visualRect(popup.model().index(row, 0)).center())
    qtbot.waitUntil(lambda: not popup.isVisible())


def test_the_group_filter_fades_the_other_group_and_the_title_counts_the_chosen_one(hybrid,
                                                                                   qtbot):
    view, _, _, snap, full_block, window_block = hybrid
    combo = view.group_filter
    assert combo.isVisible() and combo.currentText() == "All groups"
    title = view.title.text()
    for g, name in ((0, "full attention"), (1, "sliding window 8")):
        assert f"{name}: {counts(snap, g)[0]} active" in title
    active = lut_rgb(palette.CODE_ACTIVE, palette.make_lut())

    choose_by_mouse(qtbot, combo, "sliding window 8")
    image = grab_pool(view)
    assert close(cell_pixel(view, image, window_block), active)
    assert close(cell_pixel(view, image, full_block), faded(active))
    a, sh, c = counts(snap, 1)
    assert f"sliding window 8: {a} active ({sh} shared) · {c} cached" in view.title.text()
    assert "full attention:" not in view.title.text()

    combo.setFocus()
    qtbot.keyClick(combo, Qt.Key_Up)  # the entry above: full attention
    image = grab_pool(view)
    assert close(cell_pixel(view, image, full_block), active)
    assert close(cell_pixel(view, image, window_block), faded(active))
    a, sh, c = counts(snap, 0)
    assert f"full attention: {a} active ({sh} shared) · {c} cached" in view.title.text()
    qtbot.keyClick(combo, Qt.Key_Up)  # All groups: nothing faded
    assert close(cell_pixel(view, grab_pool(view), window_block), active)


def test_another_model_resets_the_filter_and_one_group_shows_the_plain_pool(hybrid, qtbot):
    view, _, mgr, snap, full_block, window_block = hybrid
    view.group_filter.setCurrentIndex(2)
    plain = KVCacheManager(64, 4)
    plain.admit(0, list(range(100, 140)))
    view.set_snapshot(plain.snapshot())
    assert not view.group_filter.isVisible()
    assert view.title.text().count("<br>") <= 1 and "full attention" not in view.title.text()
    image = grab_pool(view)
    block = int(plain.block_table(0)[6])
    assert close(cell_pixel(view, image, block, *CORNER),
                 lut_rgb(palette.CODE_ACTIVE, palette.make_lut()))  # no mark, no fade
    assert "white corner" not in view.legend.text()
    view.set_snapshot(snap)
    assert view.group_filter.isVisible() and view.group_filter.currentText() == "All groups"
    assert "white corner: a block of sliding window 8" in view.legend.text()


def test_hover_names_the_group_and_the_owners_of_every_group(hybrid, qtbot):
    view, _, _, snap, full_block, window_block = hybrid
    for block, text in (
            (window_block, "· active · ref 1 · sliding window 8 · owners #0 · tokens 24–27 of #0"),
            (full_block, "· active · ref 1 · full attention · owners #0 · tokens 20–23 of #0"),
            # #0 let it go out of its window, #1 took it back (a hit): #1's tokens
            (int(snap.tables_of(1)[1][2]), "· active · ref 1 · sliding window 8 · owners #1 · "
                                           "tokens 8–11 of #1"),
            (int(snap.tables_of(1)[0][0]), "· shared · ref 2 · full attention · owners #0 #1 · "
                                           "tokens 0–3 of #0")):
        qtbot.mouseMove(view.plot.viewport(), screen_point(view, *view.cell_center(block)))
        expected = f"block {block} {text}"
        qtbot.waitUntil(lambda: view.hover_label.text().startswith(expected))  # noqa: B023
        qtbot.wait(20)  # (a move right after the last one can be dropped offscreen)


def test_a_selected_request_is_outlined_in_every_group_and_a_click_selects_its_owner(hybrid,
                                                                                    qtbot):
    view, details, _, snap, full_block, window_block = hybrid
    view.selection.select_request(0)
    full, window = snap.tables_of(0)
    assert sorted(view.highlighted.tolist()) == sorted([*full, *window[window >= 0]])
    image = grab_pool(view)
    for b in (full_block, window_block):  # a black rim (the outline is 0.82 of a cell)
        assert close(cell_pixel(view, image, b, dx=0.41), (0, 0, 0), tol=60), b
    view.selection.select_request(None)
    assert not close(cell_pixel(view, grab_pool(view), window_block, dx=0.41), (0, 0, 0), 60)
    # a block only #0's window table holds: the click selects #0, the details name the group
    qtbot.mouseClick(view.plot.viewport(), Qt.LeftButton,
                     pos=screen_point(view, *view.cell_center(window_block)))
    assert view.selection.request == 0
    text = details.text.toPlainText()
    assert f"block {window_block} · active · ref 1 · sliding window 8" in text
    assert "attends only the last 8 tokens" in text


def test_the_title_tooltip_gives_every_groups_counts(hybrid):
    view, _, mgr, snap, _, _ = hybrid
    view.group_filter.setCurrentIndex(2)  # the title counts one group; the tooltip both
    tip = view.title.toolTip()
    for g, name in ((0, "full attention"), (1, "sliding window 8")):
        a, _, c = counts(snap, g)
        assert f"{name}: {a} active, {c} cached" in tip
    view.set_snapshot(KVCacheManager(64, 4).snapshot())
    assert "full attention" not in view.title.toolTip()
