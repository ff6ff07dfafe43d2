"""The engine process's protocol, without Qt: frames paced by the window, nothing lost."""

from __future__ import annotations

import os
import socket
import threading
from multiprocessing.connection import Connection

from kvscope.app.frames import EngineInfo, Frame
from kvscope.app.host import protocol as p
from kvscope.app.host.server import EngineHost, start
from kvscope.engine.config import EngineConfig, SamplingParams

PROMPTS = [f"Question {i}: what is a list? " * 3 for i in range(4)]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def host_in_thread() -> tuple[Connection, threading.Thread]:
    ours, theirs = socket.socketpair()
    host = threading.Thread(target=EngineHost(Connection(theirs.detach())).serve, daemon=True)
    host.start()
    return Connection(ours.detach()), host


def receive(conn: Connection, kind: type, timeout: float = 60.0) -> list:
    """Messages up to and including the first of this kind."""
    got = []
    while conn.poll(timeout):
        got.append(conn.recv())
        if isinstance(got[-1], kind):
            return got
    raise AssertionError(f"no {kind.__name__} message; got {[type(m).__name__ for m in got]}")


def test_frames_wait_for_the_window_but_every_step_record_and_event_arrives():
    conn, host = host_in_thread()
    conn.send(p.Load("demo", EngineConfig(num_blocks=64)))
    loaded = receive(conn, p.Loaded)[-1].info
    assert isinstance(loaded, EngineInfo) and loaded.num_blocks == 64
    assert loaded.model_config["architectures"]
    # the state right after loading
    frames = [m.frame for m in receive(conn, p.NewFrame) if isinstance(m, p.NewFrame)]
    for prompt in PROMPTS:
        conn.send(p.Submit(prompt, PARAMS, None))  # a user action: its frame is sent at once
    frames += [m.frame for m in _receive_n(conn, p.NewFrame, len(PROMPTS))]
    conn.send(p.Resume())
    conn.send(p.Ready())  # the window takes one frame and then, in this test, no more
    until_idle = receive(conn, p.Idle)
    sent = [m.frame for m in until_idle if isinstance(m, p.NewFrame)]
    # One frame for the one "ready", then none until the host runs out of work and sends the
    # rest (forced): the steps in between were never turned into frames, but their records
    # and events all arrive.
    assert len(sent) == 2 and sent[0].records and len(sent[1].records) > 1
    conn.send(p.Ready())  # nothing happened since the last frame: no new one
    assert not [m for m in _drain(conn) if isinstance(m, p.NewFrame)]
    frame = Frame()
    for f in frames + sent:
        frame.merge(f)
    steps = [r.step for r in frame.records]
    assert steps == list(range(len(steps))) and len(steps) >= PARAMS.max_tokens
    assert sum(r.decode_tokens + r.prefill_tokens for r in frame.records) > 0
    assert all(r.state == "finished: length" and r.output_tokens == PARAMS.max_tokens
               for r in frame.requests)
    assert sorted(frame.explanations) == list(range(len(PROMPTS)))
    finished = [e for e in frame.events if e.kind == "finished"]
    assert sorted(e.request_id for e in finished) == list(range(len(PROMPTS)))
    conn.send(p.Close())
    host.join(10)
    assert not host.is_alive()


def _receive_n(conn: Connection, kind: type, n: int) -> list:
    got = []
    while len(got) < n:
        got.append(receive(conn, kind)[-1])
    return got


def _drain(conn: Connection) -> list:
    got = []
    while conn.poll(0.2):
        got.append(conn.recv())
    return got


def test_a_bad_command_is_reported_and_the_engine_serves_on():
    conn, host = host_in_thread()
    conn.send(p.Load("demo", EngineConfig(num_blocks=64)))
    receive(conn, p.Loaded)
    conn.send(p.Submit("hello", "not sampling params", None))
    assert receive(conn, p.Rejected)[-1].message.startswith("AttributeError: ")
    conn.send(p.Cancel(12345))  # no such request: a failed command is reported, not fatal
    assert receive(conn, p.Error)[-1].message.startswith("KeyError")
    conn.send(p.Submit("hello", PARAMS, None))  # and it goes on serving
    conn.send(p.Resume())
    assert receive(conn, p.Idle)
    conn.send(p.Close())
    host.join(10)


def test_the_recording_is_finished_when_the_window_process_dies(tmp_path):
    from kvscope.sessions import SessionReader

    proc, conn = start()
    path = tmp_path / "s.kvscope"
    conn.send(p.Load("demo", EngineConfig(num_blocks=64)))
    receive(conn, p.Loaded)
    conn.send(p.Record(str(path), False))
    receive(conn, p.Recording)
    for prompt in PROMPTS:
        conn.send(p.Submit(prompt, PARAMS, None))
    conn.send(p.Resume())
    receive(conn, p.Idle)
    conn.close()  # as if the window's process were killed: no "close" command
    assert proc.wait(30) == 0
    with SessionReader(path) as reader:
        assert reader.meta.complete
        assert reader.num_steps >= PARAMS.max_tokens


def test_the_engine_keeps_its_history_and_record_saves_it_without_text(tmp_path):
    from kvscope.sessions import SessionReader

    conn, host = host_in_thread()
    conn.send(p.Load("demo", EngineConfig(num_blocks=64)))
    history = receive(conn, p.Loaded)[-1].info.history_path
    conn.send(p.Submit(PROMPTS[0], PARAMS, None))
    conn.send(p.Resume())
    receive(conn, p.Idle)
    path = tmp_path / "saved.kvscope"
    conn.send(p.Record(str(path), False))  # after the first request ran
    receive(conn, p.Recording)
    conn.send(p.Submit(PROMPTS[1], PARAMS, None))
    conn.send(p.Resume())
    receive(conn, p.Idle)
    conn.send(p.StopRecord())
    note = receive(conn, p.Recording)[-1]
    assert note.path is None and note.note.startswith("recorded ")
    with SessionReader(history) as live, SessionReader(path) as saved:
        assert saved.meta.complete and not saved.meta.record_text
        assert saved.first_step == 0 and saved.last_step == live.last_step  # the whole history
        assert [r.prompt_text for r in saved.requests()] == [None, None]
        assert saved.snapshot_at(saved.last_step).equals(live.snapshot_at(live.last_step))
    conn.send(p.Close())
    host.join(10)
    assert not host.is_alive() and not os.path.exists(history)  # removed when it closes


def test_live_frames_count_dead_blocks_over_time():
    """Under fifo, A's chain root is evicted while its tail stays cached: the engine process's
    frames outline the dead tail and carry its count per step for the timeline."""
    import random

    conn, host = host_in_thread()
    conn.send(p.Load("demo", EngineConfig(num_blocks=4, block_size=16,
                                          eviction_policy="fifo")))
    receive(conn, p.Loaded)
    rng = random.Random(0)
    a, b = [rng.randrange(100, 1000) for _ in range(33)], [rng.randrange(100, 1000)
                                                           for _ in range(47)]
    frames = []
    for prompt in (a, b):
        conn.send(p.Submit(prompt, SamplingParams(max_tokens=1, ignore_eos=True), None))
        conn.send(p.Resume())
        conn.send(p.Ready())
        frames += [m.frame for m in receive(conn, p.Idle) if isinstance(m, p.NewFrame)]
    last = frames[-1]
    assert last.dead.tolist() == [1]
    steps, counts = last.dead_counts
    assert counts[-1] == 1 and counts[0] == 0 and list(steps) == sorted(set(steps))
    conn.send(p.Close())
    host.join(10)


def test_sampled_counts_keep_their_span_when_thinned():
    from kvscope.app.host.server import SampledCounts

    c = SampledCounts(limit=8)
    for step in range(20):
        steps, counts = c.add(step, step * 2)
    assert len(steps) <= 8 and steps[0] == 0 and steps[-1] >= 16
    assert (counts == steps * 2).all()


def test_a_paced_engine_runs_at_most_that_many_steps_a_second():
    conn, host = host_in_thread()
    conn.send(p.Load("demo", EngineConfig(num_blocks=64)))
    receive(conn, p.Loaded)
    conn.send(p.Pace(25))  # 40 ms from one step's start to the next's
    conn.send(p.Submit(PROMPTS[0], PARAMS, None))
    conn.send(p.Resume())
    frame = Frame()
    for m in receive(conn, p.Idle):
        if isinstance(m, p.NewFrame):
            frame.merge(m.frame)
        conn.send(p.Ready())
    for m in _drain(conn):
        if isinstance(m, p.NewFrame):
            frame.merge(m.frame)
    starts = [r.start_s for r in frame.records]
    assert len(starts) >= PARAMS.max_tokens
    gaps = [b - a for a, b in zip(starts[1:], starts[2:], strict=False)]  # the first: a submit
    assert min(gaps) >= 0.04 * 0.95, gaps
    conn.send(p.Close())
    host.join(10)
