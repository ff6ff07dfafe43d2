"""The requests table: each row's reused | computed bar (drawn by a delegate behind the cached
count), and a finished
request's block table: which of its blocks the pool still holds (cached, or in use by another
request) and which were evicted."""

from __future__ import annotations

from image_compare import to_array
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor
from window_testutil import shown, step

from kvscope.app.frames import RequestRow
from kvscope.app.panels.requests_panel import (
    BAR,
    COMPUTED_COLOR,
    REUSED_COLOR,
    WAITING_COLOR,
    RequestsPanel,
)
from kvscope.engine.config import SamplingParams

SHARED = "Shared notes on lists and tuples, written for the course. " * 4


def rgb(color: str) -> tuple[int, int, int]:
    c = QColor(color)
    return c.red(), c.green(), c.blue()


def bar_pixels(panel, row: int, y: int | None = None) -> list[tuple[int, int, int]]:
    """The colours along a row's bar, left to right, above the number drawn on it."""
    table = panel.table
    rect = table.visualRect(panel.model.index(row, BAR))
    image = to_array(table.viewport().grab().toImage())
    y = rect.top() + 3 if y is None else y
    return [tuple(int(v) for v in image[y, x, :3]) for x in range(rect.left() + 4,
                                                                 rect.right() - 3)]


def click(panel, qtbot, row: int, column: int = 0) -> None:
    table = panel.table
    qtbot.mouseClick(table.viewport(), Qt.LeftButton,
                     pos=table.visualRect(panel.model.index(row, column)).center())


def test_each_row_has_a_reused_computed_bar(qtbot):
    panel = shown(qtbot, RequestsPanel(), (900, 300))
    panel.set_rows([RequestRow(0, "decode", 100, 0, 3, None, None, None, None, ""),
                    RequestRow(1, "decode", 100, 75, 3, None, None, None, None, ""),
                    RequestRow(2, "waiting", 100, 0, 0, None, None, None, None, "")])
    for row, reused in ((0, 0.0), (1, 0.75)):
        pixels = bar_pixels(panel, row)
        green = sum(p == rgb(REUSED_COLOR) for p in pixels)
        blue = sum(p == rgb(COMPUTED_COLOR) for p in pixels)
        assert green + blue >= len(pixels) - 2
        assert abs(green / len(pixels) - reused) < 0.03, (row, green, blue)
    waiting = bar_pixels(panel, 2)  # not looked up yet: no bar, a thin grey line below
    assert rgb(REUSED_COLOR) not in waiting and rgb(COMPUTED_COLOR) not in waiting
    line = panel.table.visualRect(panel.model.index(2, BAR)).bottom() - 3
    assert all(p == rgb(WAITING_COLOR) for p in bar_pixels(panel, 2, line))
    m = panel.model
    assert "75 of 100 prompt tokens reused" in m.data(m.index(1, BAR), Qt.ToolTipRole)
    assert "not looked up" in m.data(m.index(2, BAR), Qt.ToolTipRole)
    assert rgb(WAITING_COLOR) != rgb(COMPUTED_COLOR)

    click(panel, qtbot, 1, BAR)  # a click on the bar selects the row; the bar stays drawn
    assert panel.selection.request == 1
    pixels = bar_pixels(panel, 1)
    assert abs(sum(p == rgb(REUSED_COLOR) for p in pixels) / len(pixels) - 0.75) < 0.03


def test_a_finished_requests_block_table_lists_what_the_pool_still_holds(window, qtbot):
    requests = window.requests
    window.engine_client.submit(SHARED + "First question?",
                                SamplingParams(max_tokens=2, ignore_eos=True), None)
    step(window, qtbot, 2)  # finished: its full blocks are cached
    click(requests, qtbot, 0)
    title = requests.block_table_title
    n_blocks = len(window.selection.freed.get(0).blocks)
    full = (requests.model.rows[0].prompt_tokens + 1) // 16  # the last one is partial
    qtbot.waitUntil(lambda: title.text().startswith("#0 finished"))
    assert f"{full} of {n_blocks} blocks still in the pool ({full} cached" in title.text()
    assert "0 evicted" in title.text()

    window.engine_client.submit(SHARED + "And what about sets?", SamplingParams(max_tokens=8), None)
    step(window, qtbot)  # the second request holds the shared blocks again
    hit = requests.model.rows[1].cached_tokens // 16
    assert hit >= 1
    click(requests, qtbot, 0)
    qtbot.waitUntil(lambda: f"{hit} in use by others" in title.text())
    assert f"{full} of {n_blocks} blocks still in the pool" in title.text()

    window.engine_client.reset_prefix_cache()  # the cached ones lose their hashes: evicted
    qtbot.waitUntil(lambda: f"{full - hit} evicted" in title.text(), timeout=5000)
    assert f"{hit} of {n_blocks} blocks still in the pool" in title.text()
    assert requests.block_table.toPlainText().count("→") == n_blocks
