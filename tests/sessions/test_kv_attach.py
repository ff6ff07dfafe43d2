"""Attaching over real ZMQ sockets on loopback to a fake vLLM/SGLang publisher: live stream,
replay on attach and on gaps (both reply layouts), restarts, bad frames."""

import contextlib
import gc
import socket
import threading
import time
import warnings

import pytest
import zmq
from kv_fake_publisher import FakePublisher, batch, cleared, drain, removed, stored

from kvscope.sessions.kv_events import Attachment, Mirror, decode_batch
from kvscope.sessions.kv_events.subscriber import listen, rank_endpoint


@pytest.fixture
def fake():
    f = FakePublisher(topic=b"kv")
    yield f
    f.close()


_opened: list[Attachment] = []


@pytest.fixture(autouse=True)
def _close_attachments():
    yield
    while _opened:
        _opened.pop().close()


def attach(fake, replay=True, **kw):
    a = Attachment(fake.endpoint, fake.replay_endpoint if replay else None, topic="kv",
                   replay_timeout_s=2.0, **kw)
    _opened.append(a)
    fake.wait_subscribed()
    return a


@pytest.mark.parametrize("replay_layout", ["old", "new"])
def test_a_gap_is_repaired_by_replay(replay_layout):
    fake = FakePublisher(topic=b"kv", replay_layout=replay_layout)
    try:
        a = attach(fake)
        fake.send(0, batch([stored([1, 2], None)]))
        fake.send(1, batch([stored([3], 2)]), live=False)  # lost on the live stream
        fake.send(2, batch([stored([4], 3), removed([1])], layout="array"), live=False)
        fake.send(3, batch([stored([5], 4)]))
        drain(a, 3)
        assert fake.replay_requests == [0]  # from the last batch applied: the restart check
        h = a.health
        assert (h.gaps, h.missing, h.repaired, h.lost, h.replayed) == (1, 2, 1, 0, 2)
        assert a.mirror.tree() == {2: 1, 3: 2, 4: 3, 5: 4} and h.orphans == 0
        fake.send(4, batch([removed([5])]))
        drain(a, 4)
        assert a.mirror.num_removed == 2
    finally:
        fake.close()


def test_without_replay_a_gap_is_counted_as_lost(fake):
    a = attach(fake, replay=False)
    fake.send(0, batch([stored([1], None)]))
    fake.send(1, batch([stored([2], 1)]), live=False)
    fake.send(2, batch([stored([3], 2)]))
    drain(a, 2)
    h = a.health
    assert (h.gaps, h.repaired, h.lost, h.orphans) == (1, 0, 1, 1)
    assert "no --replay endpoint" in h.notes[-1]


def test_attach_replays_history_then_goes_live(fake):
    for seq in range(3):
        fake.send(seq, batch([stored([10 + seq], 9 + seq if seq else None)]), live=False)
    a = attach(fake).start()
    assert fake.replay_requests == [0] and a.last == 2 and a.health.first_seq == {fake.endpoint: 0}
    fake.send(2, batch([stored([999], None)]), keep=False)  # already replayed: ignored
    fake.send(3, batch([stored([13], 12)]))
    drain(a, 3)
    assert a.mirror.tree() == {10: None, 11: 10, 12: 11, 13: 12}
    assert a.health.gaps == 0 and a.health.replayed == 3 and a.health.restarts == 0


def test_a_sequence_regression_is_a_restart(fake):
    a = attach(fake)
    fake.send(0, batch([stored([1, 2], None)]))
    fake.send(1, batch([stored([3], 2)]))
    drain(a, 1)
    fake.buffer.clear()  # the new process has an empty replay buffer
    fake.send(0, batch([stored([7], None)]))
    fake.send(1, batch([cleared(), stored([8], None)]))
    drain(a, 1, messages=4)
    h = a.health
    assert h.restarts == 1 and h.gaps == 0
    assert a.mirror.tree() == {8: None} and a.mirror.num_cleared == 4


def test_two_ranks_two_groups_two_media(fake):
    a = attach(fake)
    fake.send(0, batch([stored([1, 2], None, group=0), stored([1], None, group=1)], rank=0))
    fake.send(1, batch([stored([1], None), stored([1], None, medium="CPU")], rank=1))
    fake.send(2, batch([cleared()], rank=1))
    drain(a, 2)
    assert set(a.mirror.layers()) == {(0, 0, "GPU"), (0, 1, "GPU")}
    assert a.mirror.num_cleared == 2 and a.mirror.num_stored == 5


def test_bad_frames_and_payloads_are_counted_and_the_stream_goes_on(fake):
    a = attach(fake)
    fake.send_frames([b"kv", b"hello"])  # 2 frames
    fake.send_frames([b"kv", b"short", b"x"])  # sequence not 8 bytes
    fake.send(0, b"\xc1 not msgpack")
    fake.send(1, batch([stored([1], None)]))
    drain(a, 1)
    h = a.health
    assert h.bad_messages == 3 and a.mirror.num_stored == 1 and h.gaps == 0
    assert any("not a KV-event batch" in n for n in h.notes)
    assert all("\n" not in n for n in h.notes)


def test_a_replay_endpoint_that_never_answers_times_out(fake):
    a = Attachment(fake.endpoint, "tcp://127.0.0.1:9", topic="kv", replay_timeout_s=0.2)
    _opened.append(a)
    fake.wait_subscribed()
    a.start()
    assert "did not finish its reply" in a.health.notes[-1]
    fake.send(0, batch([stored([1], None)]))
    drain(a, 0)
    assert a.mirror.num_stored == 1


def test_a_bad_address_is_a_clear_error():
    with pytest.raises(ValueError, match="not a ZMQ address"):
        Attachment("localhost:5557")
    with pytest.raises(ValueError, match="cannot connect"):
        Attachment("tcp://no port here")


def test_one_attachment_per_rank_feeds_one_mirror():
    fakes = [FakePublisher(), FakePublisher()]
    mirror = Mirror()
    atts = [Attachment(f.endpoint, f.replay_endpoint, mirror=mirror) for f in fakes]
    try:
        for f in fakes:
            f.wait_subscribed()
        for rank, f in enumerate(fakes):
            f.send(0, batch([stored([1, 2], None)], rank=rank))
            f.send(1, batch([removed([1])], rank=rank), live=False)  # a gap on each stream
            f.send(2, batch([stored([3], 2)], rank=rank))
        listen(atts, 1.0)
        assert set(mirror.layers()) == {(0, 0, "GPU"), (1, 0, "GPU")}
        h = mirror.health
        assert (h.gaps, h.repaired, mirror.num_stored, mirror.num_removed) == (2, 2, 6, 2)
        assert h.first_seq == {fakes[0].endpoint: 0, fakes[1].endpoint: 0}
    finally:
        for a in atts:
            a.close()
        for f in fakes:
            f.close()


def test_rank_endpoints_follow_vllms_port_offset():
    assert rank_endpoint("tcp://10.0.0.2:5557", 0) == "tcp://10.0.0.2:5557"
    assert rank_endpoint("tcp://10.0.0.2:5557", 3) == "tcp://10.0.0.2:5560"
    assert rank_endpoint("ipc:///tmp/kv", 0) == "ipc:///tmp/kv"
    with pytest.raises(ValueError, match="needs tcp://HOST:PORT"):
        rank_endpoint("ipc:///tmp/kv", 1)


def test_a_reset_that_removes_nothing_is_counted_and_shown():
    m = Mirror()
    m.apply(decode_batch(batch([stored([1, 2], None)])))
    m.apply(decode_batch(batch([cleared()])))
    assert (m.num_resets, m.num_cleared, m.num_removed, m.num_resident) == (1, 2, 0, 0)
    assert "  resets (AllBlocksCleared): 1, blocks cleared (resets and restarts): 2" in \
        m.summary().splitlines()


def test_an_attachment_dropped_unclosed_closes_its_sockets_and_never_stalls_its_context():
    """Its SUB stops reporting before its monitor goes: a monitor finalised first (the cycle
    collector frees in no set order) blocked the context's I/O thread at the SUB's next event,
    and six later attachments of one CI worker never joined their publishers."""
    ctx = zmq.Context()
    first, second = FakePublisher(topic=b"kv"), FakePublisher(topic=b"kv")
    try:
        dropped = Attachment(first.endpoint, topic="kv", context=ctx)
        first.wait_subscribed()
        dropped.itself = dropped  # only the cycle collector frees it
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            del dropped
            gc.collect()
        assert [str(w.message) for w in said if w.category is ResourceWarning] == []
        first.close()  # a disconnect: an event for the dropped SUB's monitor, were it still open
        late = Attachment(second.endpoint, topic="kv", context=ctx)
        second.wait_subscribed()
        late.close()
    finally:
        first.close()
        second.close()
        ctx.term()


def test_an_attachment_nobody_polls_never_stalls_the_others_of_its_context():
    """libzmq's I/O thread blocks on a full monitor queue, and every socket of its context with
    it: an attachment left unpolled while its endpoint flaps (a listener that drops each
    connection: a failed handshake and a disconnect each time) must never keep a later
    attachment on the same context from joining (it did, after about 1,000 dropped connections:
    the suite's attach tests then timed out one after another)."""
    ctx = zmq.Context()
    ctx.setsockopt(zmq.RECONNECT_IVL, 1)  # flap fast
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    drops, stop = [], threading.Event()

    def drop_each_connection():
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                listener.accept()[0].close()
                drops.append(1)

    thread = threading.Thread(target=drop_each_connection, daemon=True)
    thread.start()
    idle = Attachment(f"tcp://127.0.0.1:{listener.getsockname()[1]}", context=ctx)
    fake = FakePublisher(topic=b"kv")
    try:
        # Twice the drops that filled the queue (2 events each, 1,000 messages): a stalled I/O
        # thread makes no more connections, and this stops short.
        deadline = time.monotonic() + 30
        while len(drops) < 2000 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(drops) >= 2000, len(drops)
        ctx.setsockopt(zmq.RECONNECT_IVL, 100)
        late = Attachment(fake.endpoint, topic="kv", context=ctx)
        fake.wait_subscribed()
        fake.send(0, batch([stored([1], None)]))
        drain(late, 0)
        late.close()
    finally:
        stop.set()
        thread.join()
        listener.close()  # no more events; what is queued is read, so a stalled context can end
        while idle.monitor.poll(100):
            idle.monitor.recv_multipart()
        idle.close()
        fake.close()
        ctx.term()
