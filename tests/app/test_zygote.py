"""Engine processes forked from the window's zygote (app/host/zygote.py), without Qt: each serves
a model as a freshly started one would, with the window's environment and folder as they are at
the fork, reports how it ended, and a zygote that went is replaced."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kvscope.app.host import protocol as p
from kvscope.app.host import zygote
from kvscope.engine.config import EngineConfig

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the zygote is Linux's (elsewhere: python -c)")


def parent_of(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


def load(conn, model: str = "demo") -> object:
    conn.send(p.Load(model, EngineConfig(num_blocks=32)))
    while conn.poll(60):
        msg = conn.recv()
        if isinstance(msg, (p.Loaded, p.LoadFailed)):
            return msg
    raise AssertionError("no answer to Load")


def test_engine_processes_fork_from_one_zygote_and_say_how_they_ended(tmp_path, monkeypatch):
    first, conn1 = zygote.start()
    assert isinstance(load(conn1), p.Loaded)
    parent = zygote._zygote.proc.pid
    assert parent_of(first.pid) == parent != os.getpid()
    # what the window's process has now, the next engine process has too
    monkeypatch.setenv("KVSCOPE_ZYGOTE_PROBE", "after the zygote started")
    monkeypatch.chdir(tmp_path)
    setup = tmp_path / "setup.py"
    setup.write_text("import os, pathlib\n"
                     "pathlib.Path('seen.txt').write_text(os.environ['KVSCOPE_ZYGOTE_PROBE'])\n")
    second, conn2 = zygote.start(setup)
    assert isinstance(load(conn2), p.Loaded)
    assert parent_of(second.pid) == parent
    assert (tmp_path / "seen.txt").read_text() == "after the zygote started"

    conn1.send(p.Close())
    assert first.wait(10) == 0
    with pytest.raises(subprocess.TimeoutExpired):
        second.wait(0.2)
    assert second.poll() is None
    second.kill()
    assert second.wait(10) == -signal.SIGKILL
    assert second.poll() == -signal.SIGKILL


def test_a_zygote_that_went_is_replaced_and_a_kill_before_the_pid_is_known_holds():
    proc, conn = zygote.start()
    proc.kill()  # at once: the zygote may not have forked it yet
    assert proc.wait(60) == -signal.SIGKILL
    old = zygote._zygote.proc
    old.kill()
    old.wait()
    t = time.monotonic()
    proc, conn = zygote.start()
    assert isinstance(load(conn), p.Loaded)
    assert zygote._zygote.proc.pid != old.pid and parent_of(proc.pid) == zygote._zygote.proc.pid
    conn.send(p.Close())
    assert proc.wait(10) == 0
    assert time.monotonic() - t < 60
