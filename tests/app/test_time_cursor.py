"""One window for live and replay: a click on an event or a timeline step moves the time cursor,
and every panel shows that step; live, the same through the engine's history; replay answers
"why did this miss?" from the recording; a bad file changes nothing; Back to live loads a model."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from image_compare import to_array
from pixels import grab_pool
from PySide6.QtCore import QPointF, Qt, QUrl
from window_testutil import LOAD_TIMEOUT_MS, open_replay, open_window, step

from kvscope.app import palette
from kvscope.app.frames import evicted_at
from kvscope.app.panels.pool_view import PoolView
from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.sessions import SessionReader

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
SHARED = "Shared notes on lists and tuples. " * 12
# step -> prompts: the shared prompt is cached, evicted by the others, then asked again.
PLAN = {0: [SHARED + "First?"],
        3: [f"Filler {i}: " + "dictionaries and sets " * 16 for i in range(3)],
        14: [f"Other {i}: " + "generators and iterators " * 14 for i in range(5)],
        30: [SHARED + "Again?"]}
AGAIN = 9  # the request id of the last prompt


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """A real demo-model session under eviction pressure; the live table's states and the live
    explanations, step by step, as the window showed them."""
    from kvscope.app.host.server import RequestTable
    from kvscope.engine import Engine
    from kvscope.sessions import Recorder

    path = tmp_path_factory.mktemp("cursor") / "evict.kvscope"
    engine = Engine.from_pretrained("demo", EngineConfig(num_blocks=24, block_size=16))
    table = RequestTable()  # the engine process's requests table, fed by the step stream
    engine.subscribe(table.apply)
    states = {}
    with Recorder(path, engine):
        while engine.has_unfinished() or engine.num_steps <= max(PLAN):
            for prompt in PLAN.get(engine.num_steps, []):
                engine.add_request(prompt, PARAMS)
            engine.step()
            states[engine.num_steps - 1] = {r: row.state for r, row in table.rows.items()}
    why = engine.explain_miss(AGAIN)
    assert why.reason == "evicted"
    return path, states, why


@pytest.fixture
def replay(qtbot, tmp_path, session):
    """The window as `kvscope replay FILE` opens it: no model loaded."""
    w = open_replay(qtbot, tmp_path, session[0])
    yield w
    w.close()


def rendered(window, snap, evicted, dead=None) -> np.ndarray:
    """The pool image a fresh view of the same size draws for this snapshot (and the outlines
    of the selection and of dead blocks)."""
    ref = PoolView()
    ref.setFixedSize(window.pool.size())
    ref.show()
    ref.set_snapshot(snap, evicted)
    ref.show_dead(dead)
    ref.highlight(window.selection.highlighted(snap))
    image = to_array(grab_pool(ref))
    ref.close()
    return image


def assert_shows_step(window, reader, n) -> None:
    snap = reader.snapshot_at(n)
    evicted = evicted_at(reader.events_at(n), n)
    assert window.snapshot.equals(snap)
    assert np.array_equal(window.pool.codes, palette.display_codes(snap))
    assert sorted(window.pool.evicted.tolist()) == sorted(np.asarray(evicted).tolist())
    assert np.array_equal(to_array(grab_pool(window.pool)), rendered(window, snap, evicted))
    assert window.requests.snapshot.equals(snap) and window.tree.latest.equals(snap)


def click_event(window, qtbot, event) -> None:
    lst = window.events.list
    for i in range(lst.count()):
        if lst.item(i).data(Qt.UserRole) == event:
            lst.scrollToItem(lst.item(i))
            rect = lst.visualItemRect(lst.item(i))
            qtbot.mouseClick(lst.viewport(), Qt.LeftButton, pos=rect.center())
            return
    raise AssertionError(f"{event} is not listed")


def click_step(window, qtbot, n) -> None:
    t = window.timeline
    scene = t.block_plot.vb.mapViewToScene(QPointF(n, t.block_plot.vb.viewRange()[1][0] + 1))
    qtbot.mouseClick(t.glw.viewport(), Qt.LeftButton, pos=t.glw.mapFromScene(scene))


def click_row(window, qtbot, rid) -> None:
    table = window.requests.table
    row = [r.request_id for r in window.requests.model.rows].index(rid)
    qtbot.mouseClick(table.viewport(), Qt.LeftButton,
                     pos=table.visualRect(window.requests.model.index(row, 0)).center())


def test_replay_an_event_click_or_a_timeline_click_shows_that_step_everywhere(replay, qtbot,
                                                                             session):
    w = replay
    w.pool.setFixedSize(600, 400)
    reader = w.reader
    assert w.replay_bar.step == reader.first_step
    w.docks["events"].raise_()
    far = next(e for e in w.events.events if e.kind == "evicted" and e.step > 10)
    click_event(w, qtbot, far)
    assert w.replay_bar.step == far.step and w.replay_bar.label.text().startswith(
        f"step {far.step} ")
    assert_shows_step(w, reader, far.step)
    assert w.selection.blocks == far.blocks  # the event's blocks, outlined on its own step
    assert np.array_equal(np.sort(w.pool.highlighted), np.sort(far.blocks))

    w.docks["timeline"].raise_()
    qtbot.wait(50)
    click_step(w, qtbot, 4)
    assert w.replay_bar.step == 4 and w.timeline.cursors[0].value() == 4
    assert_shows_step(w, reader, 4)


def test_replay_requests_table_shows_each_requests_state_at_the_step(replay, session):
    _, states, _ = session
    for n in (0, 2, 5, 14, 15, 20, 31, max(states)):
        replay.replay_bar.set_step(n)
        shown = {r.request_id: r.state for r in replay.requests.model.rows}
        assert shown == states[n], f"step {n}"


def test_replay_why_did_this_miss_answers_from_the_recording(replay, qtbot, session):
    _, _, live = session
    replay.follow()  # End: the last step
    click_row(replay, qtbot, AGAIN)
    assert replay.selection.request == AGAIN
    qtbot.mouseClick(replay.requests.explain_button, Qt.LeftButton)
    text = replay.details.text.toPlainText()
    assert f"evicted at step {live.dropped_at_step}." in text
    replay.replay_bar.set_step(2)  # before it arrived
    qtbot.mouseClick(replay.requests.explain_button, Qt.LeftButton)
    assert "not been admitted" in replay.details.text.toPlainText()


def test_replay_shows_the_sessions_settings_and_disables_what_would_change_it(replay):
    assert replay.blocks_box.value() == 24 and not replay.blocks_box.isEnabled()
    assert replay.model_box.currentText() == "demo" and not replay.model_box.isEnabled()
    for button in (replay.requests.cancel_button, replay.composer.submit_button):
        assert not button.isEnabled() and "Back to live" in button.toolTip()


def test_a_corrupt_session_leaves_the_replay_as_it_was(replay, tmp_path, session):
    replay.replay_bar.set_step(7)
    before = replay.snapshot
    bad = tmp_path / "cut.kvscope"
    shutil.copyfile(session[0], bad)
    with open(bad, "r+b") as f:
        f.truncate(bad.stat().st_size // 2)
    assert not replay.open_session(str(bad))
    assert replay.banner.isVisible() and "truncated" in replay.banner.label.text()
    assert replay.reader.path == session[0] and replay.replay_bar.step == 7
    assert replay.snapshot is before and replay.replay_bar.isVisible()


def test_back_to_live_after_replay_loads_a_model_and_f5_runs_the_demo(replay, qtbot):
    assert replay.engine is None
    qtbot.mouseClick(replay.replay_bar.leave_button, Qt.LeftButton)
    assert not replay.replay_bar.isVisible() and replay.blocks_box.isEnabled()
    assert replay.blocks_box.toolTip() == "Physical blocks in the KV pool"  # the live one again
    qtbot.waitUntil(lambda: replay.engine is not None, timeout=LOAD_TIMEOUT_MS)
    assert replay.requests.cancel_button.isEnabled()
    replay.activateWindow()
    qtbot.keyClick(replay, Qt.Key_F5)
    qtbot.waitUntil(lambda: len(replay.requests.model.rows) >= 2, timeout=60_000)
    replay.engine_client.pause()


def test_live_pause_click_an_early_event_then_follow_live(qtbot, tmp_path):
    w = open_window(qtbot, tmp_path)
    try:
        w.blocks_box.setValue(24)
        w.reload()
        qtbot.waitUntil(lambda: w.engine is not None and w.engine.num_blocks == 24,
                        timeout=LOAD_TIMEOUT_MS)
        w.engine_client.submit(PLAN[0][0], PARAMS, None)
        live = {}  # step -> the pool the live view drew
        for _ in range(3):
            step(w, qtbot)
            live[w.snapshot.step] = w.pool.codes.copy()
        for prompt in PLAN[3] + PLAN[14]:
            w.engine_client.submit(prompt, PARAMS, None)
        w.engine_client.resume()
        qtbot.waitUntil(lambda: len(w.requests.model.rows) == 9 and all(
            r.state.startswith("finished") for r in w.requests.model.rows), timeout=120_000)
        newest = w.snapshot.step
        with SessionReader(w.engine.history_path) as history:  # written by the engine process
            qtbot.waitUntil(lambda: (history.refresh(), history.last_step)[1] >= newest,
                            timeout=5000)
            w.docks["events"].raise_()
            early = next(e for e in w.events.events if e.kind == "evicted")
            click_event(w, qtbot, early)
            assert w.selection.step == early.step < newest
            assert_shows_step(w, history, early.step)
            assert "history" in w.status.text()
        for n, codes in live.items():  # the history draws what the live view drew
            w.selection.select_step(n)
            assert np.array_equal(w.pool.codes, codes), f"step {n}"
        w.activateWindow()
        qtbot.keyClick(w, Qt.Key_End)
        assert w.selection.step is None and w.snapshot.step == newest
        assert all(r.state.startswith("finished") for r in w.requests.model.rows)
    finally:
        w.close()


def test_a_blocks_last_used_step_moves_the_cursor(replay, qtbot):
    w = replay
    w.replay_bar.set_step(w.reader.last_step)
    snap = w.snapshot
    block = int(np.argmin(np.where(snap.last_use >= 0, snap.last_use, 1 << 30)))
    last = int(snap.last_use[block])
    assert 0 <= last < snap.step
    x, y = w.pool.cell_center(block)
    pos = w.pool.plot.mapFromScene(w.pool.plot.plotItem.vb.mapViewToScene(QPointF(x, y)))
    qtbot.mouseClick(w.pool.plot.viewport(), Qt.LeftButton, pos=pos)
    assert w.selection.blocks == (block,)
    assert f'href="step:{last}"' in w.details.text.toHtml()
    w.details.text.anchorClicked.emit(QUrl(f"step:{last}"))  # what a click on the link sends
    assert w.replay_bar.step == last and w.snapshot.step == last
