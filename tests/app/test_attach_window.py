"""File → Attach… in the window: the mirror of a server's KV events in the panels, its health
always visible, bad input in the banner, a recording that replays like any other."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from PySide6.QtCore import QEvent, QPointF, Qt
from PySide6.QtGui import QMouseEvent
from PySide6.QtWidgets import QApplication, QDialogButtonBox
from window_testutil import bare_window, tree_blocks

from kvscope.app.prefix_tree import _parent_blocks, walk

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sessions"))
from kv_fake_publisher import FakePublisher, batch, removed, stored  # noqa: E402
from kv_metrics_server import MetricsServer  # noqa: E402
from kv_serve import finish, serve_kv_events  # noqa: E402
from tcp_proxy import TcpProxy  # noqa: E402

import kvscope.sessions.kv_events.session as attach_session  # noqa: E402


@pytest.fixture
def bare(qtbot, tmp_path):
    """The window without a model: attaching needs none."""
    w = bare_window(qtbot, tmp_path)
    yield w
    w.close()


@pytest.fixture
def fake():
    f = FakePublisher()
    yield f
    f.close()


def attach_from_menu(w, qtbot, endpoint, replay="", metrics="", record=""):
    """File → Attach… (Ctrl+Shift+A), type the addresses, press Attach."""
    before = getattr(w, "attach_window", None)
    w.activateWindow()
    qtbot.waitUntil(lambda: QApplication.activeWindow() is w, timeout=3000)
    qtbot.keyClick(w.pool, Qt.Key_A, Qt.ControlModifier | Qt.ShiftModifier)
    qtbot.waitUntil(lambda: getattr(w, "attach_window", None) not in (None, before) and
                    w.attach_window.isVisible(), timeout=3000)
    d = w.attach_window
    for field, text in ((d.endpoint, endpoint), (d.replay, replay), (d.metrics, metrics),
                        (d.record, record)):
        field.clear()
        qtbot.keyClicks(field, text)
    qtbot.mouseClick(d.buttons.button(QDialogButtonBox.Ok), Qt.LeftButton)
    assert not d.isVisible()


def test_attach_from_the_menu_shows_the_mirror_and_its_health(bare, qtbot, fake):
    w = bare
    attach_from_menu(w, qtbot, fake.endpoint, fake.replay_endpoint)
    fake.wait_subscribed(timeout_s=10)
    assert w.act_detach.isEnabled() and w.attach_view.note.isVisible()
    fake.send(0, batch([stored([1, 2, 3], None), stored([7, 8], None, medium="CPU")]))
    fake.send(1, batch([stored([4], 3), stored([5], 3)]))  # two children of block 3
    qtbot.waitUntil(lambda: w.snapshot is not None and w.snapshot.num_cached_blocks == 5
                    and w.snapshot.host is not None, timeout=5000)
    # the pool: hash slots, and it says so; the CPU tier's own slots below
    assert w.pool.title.text().startswith("<b>Hash slots</b> · GPU: 5 resident of 4096 slots")
    assert w.snapshot.host.num_cached_blocks == 2
    assert "not a physical block" in w.attach_view.note.text()
    # the tree (the GPU tier's): block 3 branching into 4 and 5
    assert tree_blocks(w) == 5 and len(w.tree.forest) == 1
    assert int((_parent_blocks(w.snapshot) == -1).sum()) == 1
    # health, always visible, green
    assert w.attach_view.health.isVisible()
    qtbot.waitUntil(lambda: "history from seq 0" in w.attach_view.health.text(), timeout=3000)
    assert w.attach_view.health.text().startswith("● mirror: gaps 0")
    assert w.status.text().startswith(f"attached · {fake.endpoint} · 5 resident blocks in 4096 "
                                      "hash slots · CPU 2")
    # a gap, repaired by replay; a removal: on the timeline
    fake.send(2, batch([removed([5])]), live=False)
    fake.send(3, batch([removed([8], medium="CPU")]))
    qtbot.waitUntil(lambda: "gaps 1 (repaired 1)" in w.attach_view.health.text(), timeout=5000)
    qtbot.waitUntil(lambda: w.snapshot.num_cached_blocks == 4, timeout=3000)
    stored_x, stored_y = w.attach_view.data["stored"]
    removed_x, removed_y = w.attach_view.data["removed"]
    assert sum(stored_y) == 7 and sum(removed_y) == 2
    qtbot.waitUntil(lambda: len(w.timeline.data["cached"]) and
                    w.timeline.data["cached"][-1] == 4, timeout=3000)
    assert "removed blocks" in w.timeline.legend
    assert not w.timeline.token_plot.getAxis("right").style["showValues"]  # no batches here
    # its stored/removed lines are on the tokens plot: shown while attached, whatever was chosen
    assert w.timeline.token_plot.isVisible() and not w.timeline.plot_actions["tokens"].isEnabled()
    # a click on a cell: what the server holds in that slot
    slot = int(np.flatnonzero(w.snapshot.state)[0])
    pool = w.pool
    scene = pool.plot.plotItem.vb.mapViewToScene(QPointF(*pool.cell_center(slot)))
    # hovering names slots, not blocks; the legend's shades mean order of storing
    # (sent to the view itself: QTest's window-level moves were not always routed to it here)
    at = QPointF(pool.plot.mapFromScene(scene))
    QApplication.sendEvent(pool.plot.viewport(), QMouseEvent(
        QEvent.MouseMove, at, pool.plot.viewport().mapToGlobal(at), Qt.NoButton, Qt.NoButton,
        Qt.NoModifier))
    qtbot.waitUntil(lambda: pool.hover_label.text().startswith(f"hash slot {slot} · cached"))
    assert "darker = stored earlier" in pool.legend.text()
    assert "evicted sooner" not in pool.legend.text()
    qtbot.mouseClick(pool.plot.viewport(), Qt.LeftButton, pos=pool.plot.mapFromScene(scene))
    text = w.details.text.toPlainText()
    assert f"hash slot {slot}: hash " in text and "dp rank 0 · KV group 0 ·" in text, text
    # a click on the health line: every line in Details
    qtbot.mouseClick(w.attach_view.health, Qt.LeftButton)
    text = w.details.text.toPlainText()
    assert "Mirror health" in text and "gaps: 1 (1 repaired by replay, 0 batches lost)" in text
    # File → Detach: back to the engine view
    w.act_detach.trigger()
    assert not w.attach_view.health.isVisible() and not w.attach_view.note.isVisible()
    assert w.source is w.live and not w.act_detach.isEnabled()
    assert "removed blocks" not in w.timeline.legend
    assert w.timeline.token_plot.getAxis("right").style["showValues"]
    assert not w.timeline.token_plot.isVisible()  # the user's choice (the default) again
    assert "darker = evicted sooner" in pool.legend.text()
    assert pool.hover_label.text() == "hover a block for details"


def test_a_dropped_connection_shows_until_the_replay_answers(bare, qtbot, fake):
    w = bare
    proxy = TcpProxy(int(fake.endpoint.rpartition(":")[2]))  # the live stream goes through it
    try:
        attach_from_menu(w, qtbot, proxy.endpoint, fake.replay_endpoint)
        fake.wait_subscribed(timeout_s=10)
        fake.send(0, batch([stored([1, 2], None)]))
        qtbot.waitUntil(lambda: w.snapshot is not None and w.snapshot.num_cached_blocks == 2,
                        timeout=5000)
        health = w.attach_view.health
        qtbot.waitUntil(lambda: health.text().startswith("● mirror: gaps 0"), timeout=3000)
        proxy.down()
        qtbot.waitUntil(lambda: "may have missed batches" in health.text(), timeout=5000)
        assert health.text().startswith("▲ ")
        fake.send(1, batch([stored([3], 2)]), live=False)  # published while cut off
        proxy.up()
        qtbot.waitUntil(lambda: w.snapshot.num_cached_blocks == 3, timeout=5000)
        qtbot.waitUntil(lambda: health.text().startswith("● mirror: gaps 1 (repaired 1)"),
                        timeout=3000)
        assert "disconnects: 1" in health.toolTip() and w.frame_timer.isActive()
    finally:
        proxy.close()


def test_bad_input_goes_to_the_banner_and_the_window_keeps_running(bare, qtbot, monkeypatch):
    w = bare
    attach_from_menu(w, qtbot, "localhost:5557")  # not a ZMQ address
    assert w.banner.isVisible() and "Cannot attach: endpoint 'localhost:5557' is not a ZMQ" \
        in w.banner.label.text()
    assert w.source is w.live
    # a ZMQ peer that is not a KV-event publisher: one-frame messages
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    try:
        attach_from_menu(w, qtbot, f"tcp://127.0.0.1:{port}")
        deadline = time.monotonic() + 10
        while "not KV events" not in w.banner.label.text():
            assert time.monotonic() < deadline, w.banner.label.text()
            pub.send(b"hello")
            qtbot.wait(50)
        assert "1-frame message" in w.banner.label.text()
    finally:
        pub.close(linger=0)
    # garbage payloads in the right framing
    f = FakePublisher()
    try:
        attach_from_menu(w, qtbot, f.endpoint)
        f.wait_subscribed(timeout_s=10)
        f.send(0, b"\x00garbage")
        qtbot.waitUntil(lambda: "payload is not a KV-event batch" in w.banner.label.text(),
                        timeout=5000)
        f.send(1, batch([stored([1], None)]))  # what is good still shows
        qtbot.waitUntil(lambda: w.snapshot.num_cached_blocks == 1, timeout=5000)
        assert w.attach_view.health.text().startswith("▲")  # something was missed
    finally:
        f.close()
    # an endpoint where nobody publishes, and metrics nobody serves
    monkeypatch.setattr(attach_session, "SILENT_S", 0.5)
    attach_from_menu(w, qtbot, "tcp://127.0.0.1:9", metrics="http://127.0.0.1:9/metrics")
    qtbot.waitUntil(lambda: "No KV events from tcp://127.0.0.1:9" in w.banner.label.text() or
                    "Metrics: cannot read" in w.banner.label.text(), timeout=5000)
    assert "Traceback" not in w.banner.label.text()
    assert w.isVisible() and w.frame_timer.isActive()


def test_metrics_on_the_timeline_beside_the_event_counts(bare, qtbot, fake):
    w = bare
    server = MetricsServer()
    try:
        attach_from_menu(w, qtbot, fake.endpoint, metrics=server.url)
        fake.wait_subscribed(timeout_s=10)
        fake.send(0, batch([stored([1, 2], None)]))
        qtbot.waitUntil(lambda: len(w.attach_view.data["kv_usage"][1]) > 0, timeout=5000)
        assert w.attach_view.data["kv_usage"][1][0] == pytest.approx(42.0)
        qtbot.waitUntil(lambda: w.snapshot is not None and w.snapshot.query_tokens == 1000,
                        timeout=5000)
        assert "hit 25% (metrics)" in w.status.text()
        assert not w.banner.isVisible()
    finally:
        server.close()


def test_the_tree_has_a_root_per_salt_and_adapter_named_by_digest(bare, qtbot, fake):
    """A vLLM chain's salt is in its first block's extra keys only; its later blocks hang under
    the same root, labelled with the salt's digest (never the salt), as a LoRA chain is with its
    adapter."""
    w = bare
    attach_from_menu(w, qtbot, fake.endpoint)
    fake.wait_subscribed(timeout_s=10)
    fake.send(0, batch([stored([1, 2], None, extra={"extra_keys": [["tenant-a"], None]}),
                        stored([4], None, lora_name="ad", extra={"extra_keys": [["ad"]]}),
                        stored([6], None, extra={"extra_keys": [None]})]))
    fake.send(1, batch([stored([3], 2, extra={"extra_keys": [None]})]))  # continues tenant-a's
    qtbot.waitUntil(lambda: w.snapshot is not None and w.snapshot.num_cached_blocks == 5,
                    timeout=5000)
    qtbot.waitUntil(lambda: tree_blocks(w) == 5 and len(w.tree.forest) == 3, timeout=3000)
    salt = w.source.session.mirror.salt_digest("tenant-a")[:8]
    labels = {w.tree.identities.labels(root)[0]: sum(n.count for n in walk(root.children))
              for root in w.tree.forest}
    assert labels == {f"no LoRA · salt #{salt}": 3, "LoRA ad · no salt": 1,
                      "no LoRA · no salt": 1}
    words = " ".join(w.tree.identities.words(root) for root in w.tree.forest)
    assert "tenant-a" not in words and f"salt #{salt}" in words


def test_a_recording_of_an_attached_session_replays_the_same_tree(bare, qtbot, fake, tmp_path):
    w = bare
    path = tmp_path / "attached.kvscope"
    attach_from_menu(w, qtbot, fake.endpoint, record=str(path))
    fake.wait_subscribed(timeout_s=10)
    assert "recording attached.kvscope" in w.recording_label.text()
    fake.send(0, batch([stored([1, 2, 3], None), stored([4], 3, group=1)]))
    fake.send(1, batch([stored([5, 6], 2), removed([1])]))
    qtbot.waitUntil(lambda: w.snapshot is not None and w.snapshot.num_cached_blocks == 5,
                    timeout=5000)
    mirror = w.source.session.mirror
    live = w.snapshot
    counts = (mirror.num_stored, mirror.num_removed, mirror.num_resident)
    w.act_detach.trigger()  # the recording is finalised
    assert w.open_session(str(path)), w.banner.label.text()
    w.selection.select_step(w.source.step_range()[1])
    replayed = w.snapshot
    assert np.array_equal(replayed.state, live.state)
    assert np.array_equal(_parent_blocks(replayed), _parent_blocks(live))
    assert (sum(w.attach_view.data["stored"][1]), replayed.num_evicted_blocks,
            replayed.num_cached_blocks) == counts == (6, 1, 5)
    assert w.pool.title.text().startswith("<b>Hash slots</b>")  # a recording of an attach


def test_attach_to_our_own_engine_publishing(bare, qtbot):
    w = bare
    with serve_kv_events(2) as served:
        attach_from_menu(w, qtbot, served.endpoint, served.replay)
        qtbot.waitUntil(lambda: served.proc.poll() is not None, timeout=60_000)
        finish(served)
    batches, events = served.batches, served.events
    mirror = w.source.session.mirror
    qtbot.waitUntil(lambda: mirror.num_stored + mirror.num_removed == events, timeout=5000)
    qtbot.waitUntil(lambda: w.snapshot.num_cached_blocks == mirror.num_resident, timeout=5000)
    assert mirror.num_removed > 0 and mirror.num_resident <= 48
    assert tree_blocks(w) == mirror.num_resident
    h = mirror.health
    assert h.lost == 0 and h.bad_messages == 0 and h.orphans == 0, h.lines()
    assert not w.banner.isVisible()
    assert batches > 0


def test_a_hybrid_server_shows_its_groups(bare, qtbot, fake, tmp_path):
    """Group 0 full attention, group 1 a window of 8 tokens: the view lists each group (index,
    kind, window, resident blocks), a cell says its group, and the pool's snapshot carries the
    groups and each slot's group."""
    w = bare
    attach_from_menu(w, qtbot, fake.endpoint)
    fake.wait_subscribed(timeout_s=10)
    full, window = dict(group=0, kind="full_attention"), dict(group=1, kind="sliding_window",
                                                              window=8)
    fake.send(0, batch([stored([1, 2, 3], None, **full), stored([1, 2, 3], None, **window)]))
    fake.send(1, batch([stored([4], 3, **window), removed([1, 2], group=1)],
                       layout="array"))
    qtbot.waitUntil(lambda: w.snapshot is not None and w.snapshot.num_cached_blocks == 5,
                    timeout=5000)
    groups = w.attach_view.groups
    qtbot.waitUntil(lambda: "2 resident" in groups.text(), timeout=3000)
    assert groups.isVisible()
    assert groups.text().splitlines() == ["KV group 0: full attention · 3 resident blocks",
                                          "KV group 1: sliding window 8 · 2 resident blocks"]
    assert " · 2 KV groups · " in w.status.text()
    snap = w.snapshot
    assert [g.name for g in snap.groups] == ["full attention", "sliding window 8"]
    held = np.flatnonzero(snap.state)
    assert sorted(snap.block_group[held].tolist()) == [0, 0, 0, 1, 1]
    # a click on a cell of group 1: Details names its group and kind
    slot = int(held[snap.block_group[held] == 1][0])
    pool = w.pool
    at = pool.plot.mapFromScene(pool.plot.plotItem.vb.mapViewToScene(
        QPointF(*pool.cell_center(slot))))
    qtbot.mouseClick(pool.plot.viewport(), Qt.LeftButton, pos=at)
    assert "· KV group 1 (sliding window 8) · GPU" in w.details.text.toPlainText()
    w.resize(1280, 720)
    qtbot.waitUntil(lambda: pool.title.text().startswith("<b>Hash slots</b>"), timeout=3000)
    w.grab().save(str(tmp_path / "attach_groups.png"))
    # File → Detach: the list goes with the attachment
    w.act_detach.trigger()
    assert not groups.isVisible()
