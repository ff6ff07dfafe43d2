"""Each panel rendered at a fixed size from fixed data, compared with a reference image."""

from __future__ import annotations

import pytest
from image_compare import assert_matches_reference, to_array
from PySide6.QtGui import QImage

from kvscope.app.frames import RequestRow
from kvscope.app.panels.events_panel import EventsPanel
from kvscope.app.panels.pool_view import PoolView
from kvscope.app.panels.requests_panel import RequestsPanel
from kvscope.app.panels.timeline import Timeline
from kvscope.engine import KVCacheManager
from kvscope.engine.metrics import StepRecord

SIZE = (640, 360)


def scenario():
    """A pool with active, shared, cached, free and evicted blocks, from the real manager."""
    mgr = KVCacheManager(96, 16)
    system = list(range(1000, 1000 + 160))
    for rid in range(4):
        mgr.admit(rid, system + [rid] * (20 + 10 * rid))
    mgr.step = 1
    mgr.free(1)
    mgr.free(3)
    mgr.admit(4, list(range(5000, 5000 + 300)))
    mgr.step = 2
    assert mgr.admit(5, list(range(9000, 9000 + 950))) == 0  # 60 blocks: evicts cached ones
    return mgr


def render(widget) -> QImage:
    widget.resize(*SIZE)
    widget.show()
    return widget.grab().toImage()


@pytest.fixture
def mgr():
    return scenario()


def test_pool_view(qtbot, mgr):
    view = PoolView()
    qtbot.addWidget(view)
    events = mgr.events.drain()
    evicted = [b for e in events if e.kind == "evicted" for b in e.blocks]
    assert evicted, "the scenario must evict"
    snap = mgr.snapshot()
    view.set_snapshot(snap, evicted)
    view.highlight(snap.block_tables[2])
    assert_matches_reference(render(view), "pool_view")


def test_requests_panel(qtbot, mgr):
    panel = RequestsPanel()
    qtbot.addWidget(panel)
    rows = [RequestRow(0, "decode", 180, 0, 12, 0.0812, 0.0123, None, None, ""),
            RequestRow(2, "decode", 210, 160, 4, 0.0211, 0.0119, "tenant-a", None, ""),
            RequestRow(4, "finished: length", 300, 0, 32, 0.1503, 0.0131, None, None, ""),
            RequestRow(6, "waiting", 44, 0, 0, None, None, None, None, ""),
            RequestRow(7, "finished: rejected", 9000, 0, 0, None, None, None, None, "")]
    panel.set_rows(rows)
    panel.select(2)
    panel.show_block_table(mgr.snapshot(), 2)
    assert_matches_reference(render(panel), "requests_panel")


def test_timeline(qtbot):
    timeline = Timeline()
    qtbot.addWidget(timeline)
    records = []
    for s in range(60):
        prefill = 400 if s % 15 == 0 else 0
        records.append(StepRecord(step=s, start_s=s * 0.05, prefill_s=prefill / 8000,
                                  decode_s=0.008 + 0.0002 * (s % 15), prefill_tokens=prefill,
                                  decode_tokens=4 + s % 15 // 3, batch_size=5 + s % 15 // 3,
                                  num_active_blocks=20 + s % 15, num_cached_blocks=s // 2,
                                  num_free_blocks=200 - 20 - s % 15 - s // 2,
                                  hit_tokens=320 if s % 15 == 0 and s else 0,
                                  query_tokens=prefill))
    timeline.add_records(records)
    timeline.set_cursor(41)
    assert_matches_reference(render(timeline), "timeline")


def test_events_panel(qtbot, mgr):
    panel = EventsPanel()
    qtbot.addWidget(panel)
    panel.add_events(mgr.events.drain())
    assert panel.list.count() > 0
    assert_matches_reference(render(panel), "events_panel")


def test_the_comparison_catches_a_changed_panel(qtbot, mgr, monkeypatch):
    """A pool drawn with another palette must fail against the reference."""
    from kvscope.app import palette

    view = PoolView()
    qtbot.addWidget(view)
    view.set_snapshot(mgr.snapshot())
    image = render(view)
    lut = palette.make_lut()
    lut[:, :3] = 255 - lut[:, :3]
    view.image.setLookupTable(lut)
    inverted = render(view)
    assert (to_array(image) != to_array(inverted)).any()
    import image_compare

    monkeypatch.setattr(image_compare, "UPDATE", False)
    with pytest.raises(AssertionError, match="differ"):
        assert_matches_reference(inverted, "pool_view")
