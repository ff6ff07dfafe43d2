"""A stopped engine process (SIGSTOP) is shown as "not responding" within a few seconds, cleared
when it answers again, and closing the window kills it quickly instead of waiting 10 s."""

from __future__ import annotations

import os
import signal
import time

from PySide6.QtCore import QSettings

import kvscope.app.host.client as client
from kvscope.app.host.client import NOT_RESPONDING
from kvscope.app.window.main_window import MainWindow
from kvscope.engine.config import DEFAULT_CPU_BLOCKS


def test_a_stopped_engine_is_reported_and_closing_kills_it(qtbot, tmp_path, monkeypatch):
    # Half the window's default pace (3 s unheard, a ping each 0.5 s): the same rules, sooner
    monkeypatch.setattr(client, "NOT_RESPONDING_S", 1.5)
    monkeypatch.setattr(client, "HEARTBEAT_MS", 250)
    w = MainWindow(settings=QSettings(str(tmp_path / "kvscope.ini"), QSettings.IniFormat))
    qtbot.addWidget(w)
    assert w.blocks_box.value() == DEFAULT_CPU_BLOCKS  # the CLI's default pool too
    w.blocks_box.setValue(64)
    w.show()
    w.load_model("demo")
    qtbot.waitUntil(lambda: w.engine is not None, timeout=60_000)
    proc = w.engine_client._current.proc
    try:
        qtbot.wait(1000)
        assert not w.banner.isVisible()  # an idle engine answers its pings (4 or so)

        os.kill(proc.pid, signal.SIGSTOP)
        t = time.monotonic()
        qtbot.waitUntil(lambda: w.banner.isVisible(), timeout=15_000)
        assert w.banner.label.text() == NOT_RESPONDING
        assert 1.25 <= time.monotonic() - t <= 5  # as 2.5 to 10 s was at 3 s

        os.kill(proc.pid, signal.SIGCONT)
        qtbot.waitUntil(lambda: not w.banner.isVisible(), timeout=10_000)

        os.kill(proc.pid, signal.SIGSTOP)
        qtbot.waitUntil(lambda: w.banner.isVisible(), timeout=15_000)
        t = time.monotonic()
        w.close()
        assert time.monotonic() - t < 3.0
        assert proc.poll() is not None  # killed, not left stopped
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
