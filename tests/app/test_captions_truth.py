"""Every caption tells the truth (issue 26, items 6, 7, 12, 13, 14, 15), at 1280x720 and 1600x1000:
hover captions said anew for each step and source; an attached server's banner, health, hover and
tooltips in its own words; a finished request's cached blocks outlined; a forked sample's cached
tokens in the history; block ticks drawn between glyphs; a partial last block explained; a lab
replay's status line said once."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from pixels import cell_pixel, close, grab_pool
from PySide6.QtCore import QEvent, QPointF, Qt
from PySide6.QtGui import QColor, QImage, QMouseEvent
from PySide6.QtWidgets import QApplication
from window_testutil import bare_window, open_replay, step

from kvscope.app import palette
from kvscope.app.panels.pool_text import block_kv_text, describe_block
from kvscope.app.panels.prefix_tree_panel import HINT, node_text
from kvscope.app.panels.text_panel import TICK, TICK_COLOR
from kvscope.app.prefix_tree import build_tree, walk
from kvscope.app.sources.lab import LabSource
from kvscope.app.window.attach_view import HEALTHY, WAITING
from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.snapshot import ACTIVE, CACHED, SHARED
from kvscope.sessions import SessionReader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sessions"))
from kv_fake_publisher import FakePublisher, batch, stored  # noqa: E402

import kvscope.sessions.kv_events.session as attach_session  # noqa: E402

SIZES = [(1280, 720), (1600, 1000)]
HEAD = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_head200.jsonl"
BS = 16
# 71 tokens: 4 full blocks and a partial one of 7; block 3 starts inside "Assistant"
PROMPT = "Assistant notes: the assistant explains lists, tuples and dictionaries. " * 3
FILLER = "Filler {}: " + "generators and iterators " * 10


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    """A session recorded with text: #0 the prompt; #1 the same prompt again (every full block
    reused, its 7 last tokens a partial block), sampled twice (#3 is forked from it); #2, #4,
    #5 fillers. At the last step #0's full blocks are cached, in no request's table."""
    from kvscope.engine import Engine
    from kvscope.sessions import Recorder

    path = tmp_path_factory.mktemp("captions") / "story.kvscope"
    engine = Engine.from_pretrained("demo", EngineConfig(num_blocks=32, block_size=BS))
    with Recorder(path, engine, record_text=True):
        engine.add_request(PROMPT, SamplingParams(max_tokens=2, ignore_eos=True))
        engine.step()
        engine.step()
        engine.add_request(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True, n=2))
        for i in range(3):
            engine.add_request(FILLER.format(i), SamplingParams(max_tokens=4, ignore_eos=True))
            engine.step()
        while engine.has_unfinished():
            engine.step()
    return path


@pytest.fixture(params=SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def size(request):
    return request.param


@pytest.fixture
def replay(qtbot, tmp_path, story, size):
    w = open_replay(qtbot, tmp_path, story, size)
    activate(w, qtbot)
    yield w
    w.close()


def activate(w, qtbot) -> None:
    w.activateWindow()
    qtbot.waitUntil(lambda: QApplication.activeWindow() is w, timeout=3000)


def move_mouse(view, at: QPointF) -> None:
    """The mouse moved to `at` (view coordinates of a QGraphicsView), sent to its viewport
    (QTest's window-level moves are not always routed to it offscreen)."""
    at = QPointF(at)
    QApplication.sendEvent(view.viewport(), QMouseEvent(
        QEvent.MouseMove, at, view.viewport().mapToGlobal(at), Qt.NoButton, Qt.NoButton,
        Qt.NoModifier))


def hover_cell(pool, block: int) -> None:
    scene = pool.plot.plotItem.vb.mapViewToScene(QPointF(*pool.cell_center(block)))
    move_mouse(pool.plot, pool.plot.mapFromScene(scene))


def hover_tree_node(tree, index: int) -> None:
    node = tree.flat[index]
    scene = tree.vb.mapViewToScene(QPointF(node.x, node.level))
    move_mouse(tree.plot, tree.plot.mapFromScene(scene))


def caught_up(tree) -> None:
    tree.flush()
    while tree.pending:
        tree.advance()


def click_row(w, qtbot, rid: int) -> None:
    table, model = w.requests.table, w.requests.model
    row = [r.request_id for r in model.rows].index(rid)
    qtbot.mouseClick(table.viewport(), Qt.LeftButton,
                     pos=table.visualRect(model.index(row, 0)).center())


def press(w, qtbot, key, times: int = 1) -> None:
    for _ in range(times):
        qtbot.keyClick(w, key)


# ---------------------------------------------------------------- item 6: hover captions
def test_the_pool_caption_is_said_anew_when_end_moves_the_cursor(replay, qtbot, story):
    w = replay
    with SessionReader(story) as r:
        first, last = r.first_step, r.last_step
        end = r.snapshot_at(last)
        # a block held by a request at some step and only cached at the last one
        block, at = next((b, s) for s in range(first, last) for b in np.flatnonzero(
            np.isin(r.snapshot_at(s).state, (ACTIVE, SHARED)) & (end.state == CACHED)).tolist())
    press(w, qtbot, Qt.Key_Home)
    press(w, qtbot, Qt.Key_Right, at - first)
    qtbot.waitUntil(lambda: w.snapshot.step == at)
    hover_cell(w.pool, block)
    caption = w.pool.hover_label
    qtbot.waitUntil(lambda: caption.text().startswith(f"block {block} · "))
    assert " · owners #" in caption.text() and " · cached · " not in caption.text()
    press(w, qtbot, Qt.Key_End)
    qtbot.waitUntil(lambda: w.snapshot.step == last)
    # The block under the mouse as the pool has it (a re-layout may send Qt's own mouse move at
    # the cursor's place, a cell away from where the test put it), said as it is at End.
    under = w.pool.block_at(w.pool._mouse)
    kv = block_kv_text(w.source.settings(), parts=False)
    assert kv == "float32 · 64 KiB"  # the demo's blocks: 16 tokens x 4096 bytes
    assert caption.text() == describe_block(end, under, kv=kv)
    if under == block:
        assert caption.text().startswith(f"block {block} · cached · ref 0 · {kv}")
        assert "owners" not in caption.text()


def test_the_tree_caption_is_said_anew_or_cleared_for_each_step_and_source(replay, qtbot,
                                                                          story, tmp_path):
    w, tree = replay, replay.tree
    press(w, qtbot, Qt.Key_End)
    caught_up(tree)
    node = next(i for i, n in enumerate(tree.flat) if not n.is_root and n.state == CACHED)
    block = tree.flat[node].blocks[0]
    hover_tree_node(tree, node)
    qtbot.waitUntil(lambda: tree.info.text().startswith(f"{tree.flat[node].count} blocks")
                    or tree.info.text().startswith(f"block {block}"))
    assert "cached" in tree.info.text()
    # a step back: the same block as that step's tree has it (or the hint, if not in it)
    press(w, qtbot, Qt.Key_Left, 3)
    caught_up(tree)
    snap = w.snapshot
    there = [n for root in build_tree(snap) for n in walk([root]) if block in n.blocks]
    assert tree.info.text() == (node_text(there[0], snap, tree.identities) if there else HINT)
    # another source: a lab replay, the session again, an attached server (nothing sent yet)
    fake = FakePublisher()
    try:
        for open_next in (lambda: w.open_source(LabSource(_trace(), 4000)),
                          lambda: w.open_session(str(story)),
                          lambda: w.attach(fake.endpoint)):
            caught_up(tree)
            hover_tree_node(tree, len(tree.flat) - 1)
            qtbot.waitUntil(lambda: tree.info.text() != HINT)
            open_next()
            assert tree.info.text() == HINT
            caught_up(tree)  # the new source's first tree
            assert tree.info.text() == HINT
    finally:
        fake.close()


def _trace():
    from kvscope.lab.traces import load_trace

    return load_trace(HEAD, limit=40)


# ---------------------------------------------------------------- item 12: finished requests
def test_a_finished_requests_cached_blocks_are_outlined_in_the_pool(replay, qtbot):
    w = replay
    press(w, qtbot, Qt.Key_End)
    snap = w.snapshot
    assert 0 not in snap.block_tables  # #0 finished long ago
    click_row(w, qtbot, 0)
    title = w.requests.block_table_title.text()
    kept = w.selection.freed.still_held(0, snap)
    assert len(kept) == 4 and title.startswith("#0 finished: 4 of 5 blocks still in the pool")
    assert sorted(w.pool.highlighted.tolist()) == sorted(kept.tolist())
    image = grab_pool(w.pool)
    outline = palette.SELECTED_OUTLINE
    others = [b for b in range(snap.num_blocks) if b not in kept and
              not any(b in t for t in snap.block_tables.values())]
    for block in kept.tolist():  # the outline's left edge, on each of them
        assert close(cell_pixel(w.pool, image, block, dx=-0.41), QColor(outline).getRgb()[:3],
                     60), block
    for block in others[:8]:
        assert not close(cell_pixel(w.pool, image, block, dx=-0.41),
                         QColor(outline).getRgb()[:3], 60), block


# ---------------------------------------------------------------- item 13: forked samples
def test_a_forked_sample_shows_its_cached_tokens_at_a_past_live_step(window, qtbot):
    """At both sizes in one window (one engine process: the test stays fast)."""
    w, client = window, window.engine_client
    client.submit(PROMPT, SamplingParams(max_tokens=2, ignore_eos=True), None)
    step(w, qtbot, 2)
    client.submit(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True, n=2), None)
    step(w, qtbot, 4)  # #1 hit #0's 4 blocks, sampled; #2 forked from it: both decoding
    model = w.requests.model

    def fork_row():
        return next(r for r in model.rows if r.parent_id == 1)

    assert fork_row().cached_tokens == 64 and fork_row().state == "decode"  # following live
    qtbot.wait(600)  # the history is committed every 0.25 s
    for size in SIZES:
        w.resize(*size)
        activate(w, qtbot)
        back = w.snapshot.step - 1
        press(w, qtbot, Qt.Key_Left)  # a step back in the history
        qtbot.waitUntil(lambda back=back: w.snapshot.step == back, timeout=5000)
        row = model.rows.index(fork_row())
        assert fork_row().state == "decode" and fork_row().cached_tokens == 64
        assert model.data(model.index(row, 0)) == "#2 (of #1)"
        assert "64 of 71 prompt tokens reused" in model.data(model.index(row, 3),
                                                             Qt.ToolTipRole)
    # a model reload (Apply): nothing the tree said of the old model stays
    caught_up(w.tree)
    hover_tree_node(w.tree, len(w.tree.flat) - 1)
    qtbot.waitUntil(lambda: w.tree.info.text() != HINT)
    old = w.engine
    qtbot.keyClick(w, Qt.Key_R, Qt.ControlModifier | Qt.ShiftModifier)
    qtbot.waitUntil(lambda: w.engine is not None and w.engine is not old, timeout=30_000)
    assert w.tree.info.text() == HINT


# ---------------------------------------------------------------- item 14: block ticks
def test_block_ticks_are_drawn_between_glyphs_and_leave_the_text_alone(replay, qtbot):
    w = replay
    press(w, qtbot, Qt.Key_End)
    w.docks["text"].show()
    w.docks["text"].raise_()
    click_row(w, qtbot, 1)
    view = w.text.view
    qtbot.waitUntil(lambda: PROMPT.strip() in view.toPlainText())
    text = view.toPlainText()
    assert TICK not in text and text.count("Assistant") == 3
    assert len(view.ticks) == (71 + 8 - 1) // BS  # the prompt's and the output's block starts
    # the tick of block 3 sits inside "Assistant" ("…A|ssistant"), drawn between the glyphs
    inside = view.ticks[2]
    assert view.document().characterAt(inside - 1) == "A" and \
        view.document().characterAt(inside) == "s"
    cursor = view.textCursor()
    cursor.setPosition(inside)
    view.setTextCursor(cursor)
    view.ensureCursorVisible()
    qtbot.wait(50)
    rect = view.tick_rects()[2]
    image = view.viewport().grab().toImage().convertToFormat(QImage.Format_RGB32)
    ratio = image.devicePixelRatio()
    column = [image.pixelColor(int(rect.left() * ratio), int(y * ratio))
              for y in range(rect.top() + 2, rect.bottom() - 1)]
    dark = QColor(TICK_COLOR)
    assert column and all(abs(c.red() - dark.red()) < 40 and abs(c.blue() - dark.blue()) < 40
                          for c in column), [c.name() for c in column]


# ---------------------------------------------------------------- item 15
def test_why_did_this_miss_says_a_partial_last_block_is_never_cached(replay, qtbot):
    w = replay
    press(w, qtbot, Qt.Key_End)
    click_row(w, qtbot, 1)
    qtbot.mouseClick(w.requests.explain_button, Qt.LeftButton)
    text = w.details.text.toPlainText()
    assert "Why #1 missed" in text and "4 block(s) (64 tokens) reused" in text
    assert "the last 7 token(s) are a partial block" in text and "never cached" in text
    assert "must always be computed" not in text
    assert w.details.isVisible() and not w.details.visibleRegion().isEmpty()


def test_the_lab_replays_status_line_says_each_thing_once(qtbot, tmp_path, size):
    w = bare_window(qtbot, tmp_path, size)
    try:
        assert w.open_lab_replay(str(HEAD), 400, BS, "lru", 40)
        qtbot.waitUntil(lambda: isinstance(w.source, LabSource), timeout=20_000)
        qtbot.waitUntil(lambda: w.status.text().startswith("replay · "))
        line = w.status.text()
        assert line.count(HEAD.name) == 1 and line.count("400 blocks") == 1, line
    finally:
        w.close()


# ---------------------------------------------------------------- item 7: attach
def test_attach_speaks_of_stored_removed_and_resident_blocks(qtbot, tmp_path, size,
                                                            monkeypatch):
    from test_attach_window import attach_from_menu

    monkeypatch.setattr(attach_session, "SILENT_S", 0.5)
    w = bare_window(qtbot, tmp_path, size)
    fake = FakePublisher()
    try:
        attach_from_menu(w, qtbot, fake.endpoint)
        fake.wait_subscribed(timeout_s=10)
        health, banner = w.attach_view.health, w.banner
        # nothing yet: the banner says so, the health is amber, not green
        qtbot.waitUntil(lambda: "No KV events from" in banner.label.text(), timeout=5000)
        assert banner.isVisible() and health.text().startswith("○ mirror: no events yet")
        assert _shows_colour(health, WAITING) and not _shows_colour(health, HEALTHY)
        # 40 blocks stored in one step, then 2 more: the banner goes, the health turns green
        fake.send(0, batch([stored(list(range(1, 41)), None)]))
        qtbot.waitUntil(lambda: w.snapshot is not None and w.snapshot.num_cached_blocks == 40,
                        timeout=5000)
        qtbot.waitUntil(lambda: not banner.isVisible(), timeout=3000)
        qtbot.waitUntil(lambda: health.text().startswith("● mirror: gaps 0"), timeout=3000)
        assert _shows_colour(health, HEALTHY) and not _shows_colour(health, WAITING)
        fake.send(1, batch([stored([41, 42], 40)]))
        qtbot.waitUntil(lambda: w.snapshot.num_cached_blocks == 42, timeout=5000)
        tl = w.timeline
        steps, counts = w.attach_view.data["stored"]
        spike = steps[counts.index(40)]
        # the spike fits the plot (not clipped at the tokens' 1)
        qtbot.waitUntil(lambda: tl.token_plot.vb.viewRange()[1][1] >= 40, timeout=3000)
        # hover its step: the readout in stored / removed / resident, not an engine's words
        vb = tl.token_plot.vb

        def spike_at() -> QPointF:
            return vb.mapViewToScene(QPointF(tl.step_x(spike), 20))

        qtbot.waitUntil(lambda: vb.sceneBoundingRect().contains(spike_at()))  # in view
        move_mouse(tl.glw, tl.glw.mapFromScene(spike_at()))
        qtbot.waitUntil(lambda: tl.readout.text().startswith(f"step {spike} "))
        words = tl.readout.text()
        assert "stored 40" in words and "removed 0" in words and "resident 40" in words
        for engine_word in ("prefill", "decode", "tokens", "batch", "active"):
            assert engine_word not in words, words
        tips = " ".join(p.toolTip() for p in tl.plots.values()) + w.pool.title.toolTip()
        assert "stored" in tips and "resident" in tips and "prefill" not in tips
        w.act_detach.trigger()  # back to the engine's words
        assert "prefill" in tl.plots["time"].toolTip()
    finally:
        w.close()
        fake.close()


def _shows_colour(label, color: str) -> bool:
    """Whether some of a label's pixels are drawn in this colour (its text's)."""
    image = label.grab().toImage().convertToFormat(QImage.Format_RGB32)
    want = QColor(color).getRgb()[:3]
    return any(close(image.pixelColor(x, y).getRgb()[:3], want, 12)
               for y in range(image.height()) for x in range(image.width()))
