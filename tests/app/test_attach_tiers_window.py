"""An attached server's tiers in the window: a recording of a server with a GPU, a CPU tier
(placeholder stores, as vLLM's offloading connector sends by default) and a STORAGE tier
(self-describing stores), replayed into the real window: three grids, each titled with its
medium, resident count and form; a hover and a click on a CPU cell say its hash, its tier and the
other tiers holding the same (group, hash). Screenshots: tests/artifacts/attach_tiers_*.png."""

from __future__ import annotations

import sys
from pathlib import Path

from PySide6.QtCore import QPointF, Qt
from window_testutil import open_replay

from kvscope.sessions.kv_events import decode_batch
from kvscope.sessions.kv_events.session import AttachSession
from kvscope.sessions.kv_events.slots import short_key

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sessions"))
from kv_fake_publisher import batch, stored  # noqa: E402

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
PLACEHOLDER = dict(block_size=0, tokens=[], medium="CPU")


def record(path: Path) -> None:
    """GPU: chains 1-2-3-4 and 10-11; CPU: placeholders of 2 and 4 (a chunk's last hash) and
    of 11; STORAGE: 3-4, self-describing."""
    session = AttachSession("tcp://127.0.0.1:9", record=str(path), num_slots=64)
    try:
        for events in ([stored([1, 2, 3, 4], None), stored([10, 11], None)],
                       [stored([2], None, **PLACEHOLDER), stored([4], None, **PLACEHOLDER),
                        stored([11], None, **PLACEHOLDER)],
                       [stored([3, 4], 2, medium="STORAGE")]):
            session.mirror.apply(decode_batch(batch(events)))
            session.tick(0.25)
    finally:
        session.close()


def cell_point(pool, tier: int, block: int):
    x, y = pool.tier_cell_center(tier, block)
    return pool.plot.mapFromScene(pool.plot.plotItem.vb.mapViewToScene(QPointF(x, y)))


def test_a_replayed_attached_session_shows_each_tier_and_where_a_hash_is(qtbot, tmp_path):
    path = tmp_path / "tiers.kvscope"
    record(path)
    w = open_replay(qtbot, tmp_path, path)
    w.selection.select_step(2)
    qtbot.waitUntil(lambda: w.snapshot is not None and w.snapshot.step == 2
                    and len(w.snapshot.tiers()) == 3, timeout=5000)
    snap, pool = w.snapshot, w.pool
    cpu, storage = snap.tiers()[1:]
    # titles: the GPU's hash slots, then a line per tier with its medium, count and form
    title = pool.title.text()
    assert title.startswith("<b>Hash slots</b> · GPU: 6 resident of 64 slots"), title
    assert ("<b>CPU tier</b> · 3 resident of 64 hash slots · placeholder stores (no tokens, "
            "block_size 0)") in title, title
    assert "<b>STORAGE tier</b> · 2 resident of 64 hash slots · self-describing stores" in title
    labels = [g.label.toPlainText() for g in pool.tier_grids.shown]
    assert labels == ["CPU tier · 64 hash slots · 3 resident · placeholder stores (no tokens, "
                      "block_size 0)",
                      "STORAGE tier · 64 hash slots · 2 resident · self-describing stores"]
    # hash 4: on the GPU, the CPU (a placeholder) and STORAGE
    h4 = short_key(0, 0, 4)
    on = {t.medium: int((t.block_hash == h4).nonzero()[0][0]) for t in snap.tiers()}
    at = cell_point(pool, 1, on["CPU"])
    qtbot.wait(20)
    qtbot.mouseMove(pool.plot.viewport(), at)
    qtbot.waitUntil(lambda: pool.hover_label.text().startswith(f"CPU hash slot {on['CPU']}"))
    hover = pool.hover_label.text()
    assert (f"resident · also in GPU (slot {on['GPU']}), STORAGE (slot {on['STORAGE']}) · "
            f"hash {h4:016x}"[:-2]) in hover, hover  # (the hash cut to 14 digits)
    ARTIFACTS.mkdir(exist_ok=True)
    w.grab().save(str(ARTIFACTS / "attach_tiers_window.png"))
    # a click: the cell is selected and Details says the same, under the tier's name
    qtbot.mouseClick(pool.plot.viewport(), Qt.LeftButton, pos=at)
    qtbot.waitUntil(lambda: w.selection.host_blocks == (on["CPU"],))
    text = w.details.text.toPlainText()
    assert text.startswith(f"CPU hash slot {on['CPU']}"), text
    assert f"also in GPU (slot {on['GPU']}), STORAGE (slot {on['STORAGE']})" in text, text
    assert "The CPU tier: placeholder stores (no tokens, block_size 0)" in text, text
    # hash 11: on the GPU and the CPU only; a STORAGE cell of 3 names the GPU alone
    h11 = short_key(0, 0, 11)
    slot11 = int((cpu.block_hash == h11).nonzero()[0][0])
    qtbot.mouseClick(pool.plot.viewport(), Qt.LeftButton, pos=cell_point(pool, 1, slot11))
    qtbot.waitUntil(lambda: w.selection.host_blocks == (slot11,))
    assert "also in GPU (slot" in w.details.text.toPlainText()
    assert "STORAGE" not in w.details.text.toPlainText().splitlines()[1]
    h3 = short_key(0, 0, 3)
    slot3 = int((storage.block_hash == h3).nonzero()[0][0])
    qtbot.mouseClick(pool.plot.viewport(), Qt.LeftButton,
                     pos=cell_point(pool, 2, slot3))
    qtbot.waitUntil(lambda: w.selection.host_blocks == (cpu.num_blocks + slot3,))
    text = w.details.text.toPlainText()
    assert text.startswith(f"STORAGE hash slot {slot3}") and "also in GPU (slot" in text, text
    assert "CPU (slot" not in text
    pool.grab().save(str(ARTIFACTS / "attach_tiers_pool.png"))
