"""A fleet recorded while attached replays as it was shown live: at two steps of the recording,
each instance row (clicked) shows the same slots in the pool and tree, the same resident blocks,
restarts and health lights in the table, and a clicked block names the same holders in Details
and in the table; an attached session recorded before the instances were named still opens."""

from __future__ import annotations

import sys
from pathlib import Path

from test_fleet_window import SHOTS, click_cell, click_row, column
from window_testutil import bare_window, tree_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sessions"))
from kv_fake_publisher import batch, removed, stored  # noqa: E402

from kvscope.app.sources.fleet_replay import FleetReplaySource  # noqa: E402
from kvscope.sessions.kv_events.fleet import Instance  # noqa: E402

NAMES = ["alpha", "beta", "gamma"]
OLD = Path(__file__).resolve().parents[1] / "data" / "fleet_before_instances.kvscope"


def held_part(w) -> str:
    """Details' words on who holds the clicked block (live, they follow the mirror's line)."""
    text = w.details.text.toPlainText()
    assert "Held by" in text, text
    return text[text.index("Held by"):]


def look(qtbot, w, hashes) -> dict:
    """What the window shows for each instance row, and for a click on each block (slot)."""
    table = w.fleet_view.table
    seen = {"table": [column(table, c) for c in (0, 2, 5)]}
    for row in range(table.rowCount()):
        click_row(qtbot, table, row)
        who = "all instances" if row == 0 else f"instance {NAMES[row - 1]}"
        qtbot.waitUntil(lambda who=who: who in w.status.text(), timeout=3000)
        snap = w.snapshot
        tiers = [(t.medium or "GPU", t.num_cached_blocks, sorted(map(int, t.block_hash[
            t.block_hash != 0]))) for t in snap.tiers()]
        seen[row] = (tiers, tree_blocks(w))
    click_row(qtbot, table, 0)
    qtbot.waitUntil(lambda: "all instances" in w.status.text(), timeout=3000)
    for slot in hashes:
        click_cell(qtbot, w.pool, slot)
        seen[("block", slot)] = (held_part(w), column(table, 6))
    return seen


def test_a_recorded_fleet_replays_its_table_filter_and_holders(qtbot, tmp_path, fakes):
    path = tmp_path / "fleet.kvscope"
    w = bare_window(qtbot, tmp_path, (1280, 720))
    assert w.attach(fleet=[Instance(n, f.endpoint, f.replay_endpoint)
                           for n, f in zip(NAMES, fakes, strict=True)],
                    record=str(path), slots=256)
    for f in fakes:
        f.wait_subscribed(timeout_s=10)
    a, b, c = fakes
    table = w.fleet_view.table
    a.send(0, batch([stored([1, 2, 3], None), stored([4], 3)]))
    b.send(0, batch([stored([1, 2], None), stored([8], None, medium="CPU")]))
    c.send(0, batch([stored([9], None)]))
    qtbot.waitUntil(lambda: column(table, 2) == ["8", "4", "3", "1"], timeout=5000)
    slots = w.source.session.slots.slot_of
    clicks = [slots[(0, 0, "GPU", 2)], slots[(2, 0, "GPU", 9)]]
    first = look(qtbot, w, clicks)
    step_a = w.snapshot.step
    # then: beta drops a block, alpha stores more, gamma's publisher restarts (seq goes back)
    b.send(1, batch([removed([2]), stored([5], 1)]))
    a.send(1, batch([stored([9], None)]))
    with c._lock:
        c.buffer.clear()
    c.send(0, batch([stored([10, 11], None)]))
    qtbot.waitUntil(lambda: column(table, 5) == ["1", "0", "0", "1"], timeout=5000)
    qtbot.waitUntil(lambda: column(table, 2) == ["10", "5", "3", "2"], timeout=5000)
    clicks += [slots[(1, 0, "GPU", 5)], slots[(0, 0, "GPU", 9)]]
    second = look(qtbot, w, clicks[1:])
    step_b = w.snapshot.step
    assert first[1] != second[1] and first["table"] != second["table"]  # the steps differ
    assert second["table"][0][1:] == ["●", "●", "▲"]
    w.close()

    r = bare_window(qtbot, tmp_path, (1280, 720), name="r.ini")
    assert r.open_session(str(path))
    assert isinstance(r.source, FleetReplaySource)
    rt = r.fleet_view.table
    assert rt.isVisible() and column(rt, 1) == ["all instances", *NAMES]
    for step, live, blocks in ((step_a, first, clicks[:2]), (step_b, second, clicks[1:])):
        r.selection.select_step(step)
        qtbot.waitUntil(lambda step=step: r.snapshot.step == step, timeout=3000)
        if step == step_b:  # alpha's block 2, clicked at the first step: its holders now
            assert column(rt, 6)[1:] == ["GPU · prefix 2/2", "not held · prefix 1/2",
                                         "not held"]
        replayed = look(qtbot, r, blocks)
        assert replayed["table"] == live["table"], step
        for key, want in live.items():
            if key != "table":
                assert replayed[key] == want, (step, key)
        if step == step_a:
            # the screenshot: beta picked at the first step, alpha's block 2 clicked before
            click_cell(qtbot, r.pool, clicks[0])
            click_row(qtbot, rt, 2)
            qtbot.waitUntil(lambda: "instance beta" in r.status.text(), timeout=3000)
            tree_blocks(r)
            SHOTS.mkdir(exist_ok=True)
            r.grab().save(str(SHOTS / "fleet_replay_1280x720.png"))
    assert "restart 1 at step" in rt.item(3, 1).toolTip()
    click_row(qtbot, rt, 3)  # gamma after its restart, its events in the log
    qtbot.waitUntil(lambda: "instance gamma" in r.status.text(), timeout=3000)
    r.docks["events"].raise_()
    tree_blocks(r)
    r.grab().save(str(SHOTS / "fleet_replay_restart_1280x720.png"))
    r.close()


def test_a_fleet_recorded_before_the_instances_were_named_opens(qtbot, tmp_path):
    """tests/data/fleet_before_instances.kvscope (kvscope at 7118bf2: its block events name no
    instance) opens as the plain replay it was: pool, tree and scrubber, no instance table."""
    path = tmp_path / "old.kvscope"
    path.write_bytes(OLD.read_bytes())
    r = bare_window(qtbot, tmp_path, (1280, 720))
    assert r.open_session(str(path))
    assert not isinstance(r.source, FleetReplaySource)
    assert not r.fleet_view.table.isVisible()
    r.selection.select_step(r.source.step_range()[1])
    # alpha 1 2 3 4, beta 1 5 (8 in its CPU tier), gamma 10 11 after its restart
    qtbot.waitUntil(lambda: r.snapshot.num_cached_blocks == 8, timeout=3000)
    assert r.snapshot.host.num_cached_blocks == 1
    assert tree_blocks(r) == 8
    r.close()
