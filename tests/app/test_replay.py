"""Record live in the window, replay the file in the same window: every scrubbed step draws the
same pool image as the live window did at that step. Export from the GUI too."""

from __future__ import annotations

import copy
import json

import numpy as np
from image_compare import to_array
from pixels import grab_pool
from PySide6.QtCore import Qt
from window_testutil import step

from kvscope.engine.config import SamplingParams

SYSTEM = "You are a careful assistant for people who learn Python. " * 5


def relabelled(snap):
    """The snapshot with its block hashes renamed by first appearance: recordings store hashes
    under a key of their own (Recorder.stored_hash), so a replay equals the live snapshot up to
    a one-to-one renaming of the hashes."""
    out = copy.copy(snap)
    both = np.concatenate([snap.block_hash, snap.parent_hash])
    _, first, inverse = np.unique(both, return_index=True, return_inverse=True)
    labels = np.argsort(np.argsort(first))[inverse].astype(np.uint64) + 1
    labels[both == 0] = 0
    out.block_hash, out.parent_hash = labels[:len(snap.block_hash)], labels[len(snap.block_hash):]
    return out


def test_record_then_replay_draws_the_same_pool(window, qtbot, tmp_path):
    path = tmp_path / "live.kvscope"
    window.pool.setFixedSize(600, 400)  # the replay bar must not change the rendering's size
    window.start_recording(str(path))
    qtbot.waitUntil(lambda: window.recording_path == str(path), timeout=5000)
    for i in range(3):
        window.engine_client.submit(SYSTEM + f"Question {i}?", SamplingParams(max_tokens=12),
                                     None)
    live = {}
    for _ in range(8):
        step(window, qtbot)
        live[window.snapshot.step] = (window.snapshot, window.pool.codes.copy(),
                                      to_array(grab_pool(window.pool)))
    cached_live = {r.request_id: (r.state, r.cached_tokens) for r in window.requests.model.rows}
    window.toggle_recording()  # stop
    qtbot.waitUntil(lambda: window.recording_path is None, timeout=5000)
    assert window.last_session == str(path)

    assert window.open_session(str(path))
    assert window.replay_bar.isVisible()
    for s in (0, 3, 5, 7):
        window.replay_bar.set_step(s)
        snap, codes, image = live[s]
        assert relabelled(window.snapshot).equals(relabelled(snap))
        assert not np.array_equal(window.snapshot.block_hash, snap.block_hash)  # keyed
        assert np.array_equal(window.pool.codes, codes), f"step {s}"
        assert np.array_equal(to_array(grab_pool(window.pool)), image), f"step {s}"
    # The requests table at the last step: still-running requests keep their cached counts
    # (known from their admission; the file writes a request's row only when it finishes).
    assert any(state in ("prefill", "decode") and cached > 0
               for state, cached in cached_live.values())
    assert {r.request_id: (r.state, r.cached_tokens)
            for r in window.requests.model.rows} == cached_live
    # Keyboard: ← steps back, → steps on.
    window.replay_bar.set_step(5)
    window.activateWindow()
    qtbot.waitUntil(window.isActiveWindow)
    qtbot.keyClick(window, Qt.Key_Left)
    assert window.replay_bar.step == 4
    qtbot.keyClick(window, Qt.Key_Right)  # the replay bar's key (Step is the live engine's)
    assert window.replay_bar.step == 5

    out = tmp_path / "trace.json"
    window.range_export.ask_path = lambda title, suggested, filters: (str(out), filters[0])
    assert window.files.export_dialog() == [out]
    trace = json.loads(out.read_text())
    assert trace["traceEvents"]
    window.leave_replay()
    assert not window.replay_bar.isVisible() and window.reader is None


def test_jump_to_the_next_eviction(window, qtbot, tmp_path):
    from kvscope.engine.snapshot import Snapshot  # noqa: F401 - the same type in replay

    window.blocks_box.setValue(24)
    window.reload()
    qtbot.waitUntil(lambda: window.engine is not None and window.engine.num_blocks == 24,
                    timeout=30_000)
    path = tmp_path / "evict.kvscope"
    window.start_recording(str(path))
    qtbot.waitUntil(lambda: window.recording_path == str(path), timeout=5000)
    for i in range(8):  # 8 x ~5 blocks through a 24-block pool: later ones evict cached blocks
        window.engine_client.submit(f"Note {i}: " + "lists and tuples " * 20,
                                     SamplingParams(max_tokens=8), None)
    window.engine_client.resume()
    qtbot.waitUntil(lambda: len(window.requests.model.rows) == 8 and all(
        r.state.startswith("finished") for r in window.requests.model.rows), timeout=30_000)
    window.toggle_recording()
    qtbot.waitUntil(lambda: window.recording_path is None, timeout=5000)
    assert window.open_session(str(path))
    bar = window.replay_bar
    bar.jump_kind.setCurrentText("eviction")
    bar.set_step(0)
    bar.jump_next()
    target = bar.step
    assert target > 0
    assert any(e.kind == "evicted" for e in window.reader.events_at(target))
    assert not any(e.kind == "evicted" for s in range(1, target)
                   for e in window.reader.events_at(s))


def test_a_corrupt_session_file_shows_an_error_and_changes_nothing(window, tmp_path):
    bad = tmp_path / "bad.kvscope"
    bad.write_bytes(b"not a database at all" * 50)
    before = bad.read_bytes()
    assert not window.open_session(str(bad))
    assert window.banner.isVisible() and "session" in window.banner.label.text().lower()
    assert window.reader is None and bad.read_bytes() == before
