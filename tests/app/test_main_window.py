"""The live inspector on the demo model: pixel checks of meaning on a real rendering."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pixels import cell_pixel, close, grab_pool, lut_rgb
from window_testutil import open_window, step

from kvscope.app import palette
from kvscope.engine.config import SamplingParams
from kvscope.engine.snapshot import CACHED, FREE, SHARED

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
SYSTEM = ("You are a careful assistant for people who learn Python. Answer in plain words and "
          "give one short example. ") * 4
GREEDY = SamplingParams(max_tokens=24)


def submit_shared(window, qtbot, n=3):
    for i in range(n):
        window.engine_client.submit(SYSTEM + f"Question {i}: what is a tuple?", GREEDY, None)
    step(window, qtbot, 2)


def test_shared_blocks_are_painted_shared_and_unused_blocks_free(window, qtbot):
    submit_shared(window, qtbot)
    snap = window.snapshot
    shared = np.flatnonzero(snap.state == SHARED)
    never_used = np.flatnonzero((snap.state == FREE) & (snap.last_use < 0))
    assert len(shared) >= 5 and len(never_used) > 100
    image = grab_pool(window.pool)
    lut = window.pool.image.lut if window.pool.image.lut is not None else palette.make_lut()
    codes = palette.display_codes(snap)
    for b in shared:
        got = cell_pixel(window.pool, image, int(b))
        assert close(got, lut_rgb(int(codes[b]), lut)), (b, got)
        assert got[0] > got[2] + 100  # orange, not blue or green
    for b in never_used[:: max(1, len(never_used) // 40)]:
        assert close(cell_pixel(window.pool, image, int(b)), (0xEE, 0xEE, 0xEE)), b


def test_selecting_a_request_highlights_exactly_its_blocks(window, qtbot):
    submit_shared(window, qtbot)
    rid = 1
    window.selection.select_request(rid)
    qtbot.waitUntil(lambda: len(window.pool.highlighted) > 0)
    table = window.snapshot.block_tables[rid]
    assert sorted(window.pool.highlighted.tolist()) == sorted(table.tolist())
    image = grab_pool(window.pool)
    others = [b for b in range(window.snapshot.num_blocks) if b not in set(table.tolist())]
    edge = 0.41  # the outline square is 0.82 of a cell wide
    for b in table.tolist():
        assert max(cell_pixel(window.pool, image, b, dx=edge)) < 60, b  # a dark outline
    for b in others[:30]:
        assert max(cell_pixel(window.pool, image, b, dx=edge)) > 60, b
    # The requests table selected the same row, and the block table names the blocks.
    assert window.requests.selected == rid
    assert f"0→{table[0]}" in window.requests.block_table.toPlainText()


def test_a_cancelled_request_gives_its_blocks_back(window, qtbot):
    window.engine_client.submit(SYSTEM + "Tell me about lists.", SamplingParams(max_tokens=200),
                                 None)
    step(window, qtbot, 3)
    rid = 0
    blocks = window.snapshot.block_tables[rid].tolist()
    assert blocks
    window.engine_client.cancel(rid)
    qtbot.waitUntil(lambda: any(r.request_id == rid and r.state == "finished: cancelled"
                                for r in window.requests.model.rows), timeout=5000)
    step(window, qtbot)  # the cancellation is reported and drawn
    snap = window.snapshot
    assert rid not in snap.block_tables
    assert set(snap.state[blocks].tolist()) <= {FREE, CACHED}
    image = grab_pool(window.pool)
    lut = palette.make_lut()
    codes = palette.display_codes(snap)
    for b in blocks:
        assert close(cell_pixel(window.pool, image, b), lut_rgb(int(codes[b]), lut)), b
    assert any(r.request_id == rid and r.state == "finished: cancelled"
               for r in window.requests.model.rows)


def test_an_engine_error_shows_a_message_and_the_window_keeps_working(qtbot, tmp_path,
                                                                      monkeypatch):
    fault = tmp_path / "fault"
    monkeypatch.setenv("KVSCOPE_TEST_FAULT", str(fault))  # the engine process inherits it
    window = open_window(qtbot, tmp_path, engine_setup=Path(__file__).with_name("engine_faults.py"))
    fault.touch()  # from now on every forward pass in the engine process raises
    window.submit("Hello there", GREEDY, None)  # submits and runs
    qtbot.waitUntil(lambda: window.banner.isVisible(), timeout=10_000)
    assert "simulated kernel failure" in window.banner.label.text()
    assert "Traceback" in window.banner.detail
    qtbot.waitUntil(lambda: [r.state for r in window.requests.model.rows] == ["finished: error"],
                    timeout=10_000)
    # Still responsive: the selection works and, with the fault gone, the engine steps again.
    window.selection.select_block(3)
    assert "block 3" in window.details.text.toPlainText()
    fault.unlink()
    window.submit("Hello again", GREEDY, None)
    qtbot.waitUntil(lambda: [r.state.split(":")[0] for r in window.requests.model.rows]
                    == ["finished", "finished"] and window.requests.model.rows[1].state !=
                    "finished: error", timeout=20_000)


def test_a_killed_engine_process_is_reported_and_a_new_one_can_be_loaded(window, qtbot):
    import os
    import signal

    os.kill(window.engine_client.pid, signal.SIGKILL)
    qtbot.waitUntil(lambda: window.banner.isVisible(), timeout=10_000)
    assert "engine process stopped unexpectedly (killed by SIGKILL)" in window.banner.label.text()
    assert window.engine is None
    window.submit("Hello there", GREEDY, None)  # says so, and nothing else happens
    assert "No model is loaded" in window.banner.label.text()
    window.load_model("demo")
    qtbot.waitUntil(lambda: window.engine is not None, timeout=30_000)
    window.submit("Hello there", GREEDY, None)
    qtbot.waitUntil(lambda: any(r.state.startswith("finished") for r in
                                window.requests.model.rows), timeout=20_000)


def test_loading_another_model_finishes_the_recording_and_says_so(window, qtbot, tmp_path):
    from kvscope.sessions import SessionReader

    path = tmp_path / "before-reload.kvscope"
    window.start_recording(str(path))
    qtbot.waitUntil(lambda: window.recording_path == str(path), timeout=5000)
    window.submit("Hello there", GREEDY, None)
    qtbot.waitUntil(lambda: any(r.state.startswith("finished") for r in
                                window.requests.model.rows), timeout=20_000)
    old_pid = window.engine_client.pid
    window.load_model("demo")  # a new engine process; the old one closes its file
    qtbot.waitUntil(lambda: window.engine_client.pid != old_pid and window.recording_path is None,
                    timeout=30_000)
    assert window.last_session == str(path)
    with SessionReader(path) as reader:
        assert reader.meta.complete and reader.num_steps >= GREEDY.max_tokens


def test_cancelling_a_load_stops_it_and_keeps_the_model_that_runs(window, qtbot):
    old, old_pid = window.engine, window.engine_client.pid
    window.load_model("demo")
    assert window.engine_client.loading
    from PySide6.QtWidgets import QPushButton

    window.progress.findChild(QPushButton).click()  # the dialog's Cancel button
    assert not window.engine_client.loading
    assert window.engine is old and window.engine_client.pid == old_pid
    qtbot.wait(500)  # a killed load must not report anything late
    assert window.engine is old and not window.banner.isVisible()
    window.submit("Hello there", GREEDY, None)
    qtbot.waitUntil(lambda: any(r.state.startswith("finished") for r in
                                window.requests.model.rows), timeout=20_000)


def test_a_broken_model_folder_shows_an_error_and_keeps_the_old_model(window, qtbot, tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    old = window.engine
    window.load_model(str(tmp_path))
    qtbot.waitUntil(lambda: window.banner.isVisible(), timeout=10_000)
    assert "config.json" in window.banner.label.text()
    assert window.engine is old


def test_main_window_screenshot(window, qtbot):
    """Saved as a test artifact (the README image is test_demo_screenshots.py's)."""
    submit_shared(window, qtbot, n=4)
    step(window, qtbot, 6)
    window.selection.select_request(2)
    # The tree is rebuilt a slice per frame: wait for the last slice to be shown.
    qtbot.waitUntil(lambda: not window.tree.pending and len(window.tree.flat) > 1)
    qtbot.wait(100)
    ARTIFACTS.mkdir(exist_ok=True)
    image = window.grab().toImage()
    assert image.save(str(ARTIFACTS / "main_window.png"))


def test_f5_runs_the_demo_workload_and_later_requests_reuse_the_system_prompt(window, qtbot):
    from PySide6.QtCore import Qt

    window.activateWindow()
    qtbot.keyClick(window, Qt.Key_F5)
    qtbot.waitUntil(lambda: sum(r.state.startswith("finished")
                                for r in window.requests.model.rows) >= 5, timeout=60_000)
    window.pause()  # the whole demo fills a 2048-block pool: tests/engine/test_demo_workload.py
    rows = sorted(window.requests.model.rows, key=lambda r: r.request_id)[:5]
    assert rows[0].cached_tokens == 0
    assert all(r.cached_tokens >= 300 for r in rows[1:])  # the ~330-token system prompt


def test_the_dock_layout_is_remembered(qtbot, tmp_path):
    from PySide6.QtCore import QSettings

    from kvscope.app.window.main_window import MainWindow

    settings = QSettings(str(tmp_path / "layout.ini"), QSettings.IniFormat)
    first = MainWindow(settings=settings)
    qtbot.addWidget(first)
    first.show()
    first.docks["events"].hide()
    first.close()
    second = MainWindow(settings=settings)
    qtbot.addWidget(second)
    second.show()
    assert not second.docks["events"].isVisible()
    assert second.docks["requests"].isVisible()
    second.close()


def test_the_capacity_tab_describes_the_loaded_model_as_the_engine_allocates_it(window):
    per_token = window.engine.kv_bytes_per_token  # from the real cache tensor
    assert window.capacity.bytes_per_token_label.text().startswith(f"{per_token:,} B")
    assert window.docks["capacity"].isVisible() or window.docks["details"].isVisible()


WINDOW_WITHOUT_TORCH = """
import sys, time
from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QApplication
from kvscope.app.window.main_window import MainWindow
from kvscope.engine.config import SamplingParams
app = QApplication([])
w = MainWindow(settings=QSettings(sys.argv[1], QSettings.IniFormat))
w.blocks_box.setValue(64)
w.show()
w.load_model("demo")
deadline = time.monotonic() + 60
def wait(cond):
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        app.processEvents()
        time.sleep(0.01)
wait(lambda: w.engine is not None)
w.submit("Hello there", SamplingParams(max_tokens=4), None)
wait(lambda: w.requests.model.rows and w.requests.model.rows[0].state.startswith("finished"))
w.explain(0)
w.close()
print("torch" in sys.modules)
"""


def test_the_window_process_never_imports_torch(tmp_path):
    """Torch lives in the engine process only: what crosses the socket (frames, the engine's
    description, why a request missed) unpickles without it, and the window starts light."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", WINDOW_WITHOUT_TORCH, str(tmp_path / "s.ini")],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"
