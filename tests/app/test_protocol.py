"""The typed engine-process protocol (app/host/protocol.py): every command and message goes
over the socket and back unchanged; an unknown or malformed one is a clear error, answered by
the engine process (which serves on) and shown in the window's banner."""

from __future__ import annotations

import os
import socket
import threading
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from window_testutil import open_window

from kvscope.app.frames import EngineInfo, Frame
from kvscope.app.host import protocol as p
from kvscope.app.host.server import EngineHost
from kvscope.engine.config import EngineConfig, SamplingParams

SAMPLES = {
    p.Load: p.Load("demo", EngineConfig(num_blocks=8)),
    p.Submit: p.Submit([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3),
                       "salt", True),
    p.RunWorkload: p.RunWorkload("w.jsonl"), p.Resume: p.Resume(), p.Pause: p.Pause(),
    p.Pace: p.Pace(2.5), p.Step: p.Step(), p.Cancel: p.Cancel(3),
    p.ResetPrefixCache: p.ResetPrefixCache(), p.Record: p.Record("s.kvscope", True),
    p.StopRecord: p.StopRecord(), p.Watch: p.Watch(None), p.Ready: p.Ready(),
    p.Ping: p.Ping(), p.Close: p.Close(),
    p.Loaded: p.Loaded(EngineInfo("demo", {}, "cpu", "float32", 64, 8, 16)),
    p.LoadFailed: p.LoadFailed("OSError: no", "tb"), p.Error: p.Error("KeyError: 3", "tb"),
    p.RequestFailed: p.RequestFailed("request #1 failed", "tb"),
    p.Rejected: p.Rejected("empty prompt"), p.Submitted: p.Submitted(4),
    p.Running: p.Running(True), p.Recording: p.Recording(None, "recorded 3 steps"),
    p.Idle: p.Idle(), p.NewFrame: p.NewFrame(Frame()), p.Pong: p.Pong(),
    p.Exited: p.Exited("exit code 1"), p.Unreadable: p.Unreadable("UnpicklingError: x"),
}


def _pair() -> tuple[Connection, Connection]:
    a, b = socket.socketpair()
    return Connection(a.detach()), Connection(b.detach())


def test_every_command_and_message_goes_over_the_socket_and_back():
    assert set(SAMPLES) == set(p.COMMANDS) | set(p.MESSAGES)
    ours, theirs = _pair()
    for cls, sample in SAMPLES.items():
        ours.send(sample)
        got = theirs.recv()
        assert type(got) is cls
        if cls is p.NewFrame:
            assert repr(got.frame) == repr(sample.frame)
        elif cls is p.Load:
            assert got.model == sample.model and got.config == sample.config
        else:
            assert got == sample
        allowed = p.COMMANDS if issubclass(cls, p.Command) else p.MESSAGES
        assert p.check(got, allowed, "x") is got


@pytest.mark.parametrize("bad,says", [
    (("ping",), "unknown engine command: tuple ('ping',)"),
    (p.Pong(), "unknown engine command: Pong"),
    (p.Pace("fast"), "malformed engine command Pace: steps_per_second is str 'fast'"),
    (p.Cancel(None), "malformed engine command Cancel: request_id is NoneType"),
    (p.Record("a", "yes"), "malformed engine command Record: record_text is str"),
])
def test_check_names_what_is_wrong_in_one_line(bad, says):
    with pytest.raises(p.ProtocolError) as e:
        p.check(bad, p.COMMANDS, "engine command")
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


def test_the_engine_process_answers_a_bad_command_with_an_error_and_serves_on():
    ours, theirs = _pair()
    host = threading.Thread(target=EngineHost(theirs).serve, daemon=True)
    host.start()
    for bad, says in [(("submit", "hi", None, None), "unknown engine command: tuple"),
                      (p.Watch("three"), "malformed engine command Watch: request_id"),
                      (b"raw bytes", "malformed engine command: "),  # does not unpickle
                      (p.Idle(), "unknown engine command: Idle")]:
        if isinstance(bad, bytes):
            ours.send_bytes(bad)
        else:
            ours.send(bad)
        got = [ours.recv() for _ in range(2)]
        assert got[0] == p.Running(False) and isinstance(got[1], p.Error), got
        assert got[1].message.startswith(says) and "\n" not in got[1].message
        ours.send(p.Ping())
        assert ours.recv() == p.Pong()  # still serving
    ours.send(p.Close())
    host.join(10)
    assert not host.is_alive()


class _Proc:
    last_heard = 0.0


def test_the_client_turns_an_unknown_or_malformed_message_into_an_engine_error(qtbot):
    from kvscope.app.host.client import EngineClient

    client = EngineClient()
    try:
        errors = []
        client.engine_error.connect(lambda message, detail: errors.append(message))
        proc = _Proc()
        client._on_message(proc, ("frame", None))  # the old protocol's
        client._on_message(proc, p.Running("yes"))
        client._on_message(proc, p.Ping())  # a command, not a message
        client._on_message(proc, p.Unreadable("UnpicklingError: invalid load key"))
        assert errors == [
            "unknown message from the engine process: tuple ('frame', None)",
            "malformed message from the engine process Running: running is str 'yes', expected "
            "bool",
            "unknown message from the engine process: Ping Ping()",
            "an unreadable message from the engine process (UnpicklingError: invalid load key)"]
    finally:
        client.shutdown()


@pytest.mark.parametrize("what,says", [
    ("tuple", "unknown message from the engine process: tuple ('frame', None)"),
    ("bytes", "an unreadable message from the engine process (UnpicklingError"),
    ("frame", "malformed message from the engine process Recording: path is int 3"),
])
def test_a_bad_message_from_the_engine_reaches_the_banner(qtbot, tmp_path, monkeypatch, what,
                                                          says):
    flag = tmp_path / "bad"
    monkeypatch.setenv("KVSCOPE_TEST_BAD_MESSAGE", str(flag))
    window = open_window(qtbot, tmp_path,
                         engine_setup=str(Path(__file__).with_name("engine_bad_messages.py")))
    flag.write_text(what)  # the next heartbeat's answer
    qtbot.waitUntil(lambda: says in window.banner.label.text(), timeout=10_000)
    os.remove(flag)
    window.close()
