"""Attach across what networks and servers do, against the fake publisher over real sockets: a
restart hidden in a gap, a replay that lost the last batch applied, disconnects (through a TCP
proxy that can drop the connection) with and without a replay endpoint, and a replay that does not
answer after a reconnect."""

import time

import pytest
import zmq
from kv_fake_publisher import FakePublisher, batch, drain, stored
from tcp_proxy import TcpProxy

import kvscope.sessions.kv_events.subscriber as subscriber
from kvscope.sessions.kv_events import Attachment


@pytest.fixture
def fake():
    f = FakePublisher()
    f.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, also a reconnect's
    yield f
    f.close()


@pytest.fixture
def proxy(fake):
    p = TcpProxy(int(fake.endpoint.rpartition(":")[2]))
    yield p
    p.close()


def poll_until(att, condition, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, att.health.lines() + list(att.health.notes)
        att.poll(10)


def wait_resubscribed(fake, att, timeout_s=5.0):
    """Until the subscriber's subscription is back at the publisher (its XPUB says
    unsubscribe when the connection drops and subscribe when it returns). The SUB socket sends
    it again only once polled after reconnecting: polled here, as its driver would."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        att.poll(0)
        if fake.pub.poll(20) and fake.pub.recv()[:1] == b"\x01":
            return
    raise TimeoutError("the subscriber did not subscribe again")


def missed(att) -> bool:
    return "may have missed batches" in att.health.lines()[0]


def new_lifetime(fake, n):
    """The publisher restarted: its replay buffer holds only the new lifetime's batches."""
    with fake._lock:
        fake.buffer.clear()
    for seq in range(n):
        fake.send(seq, batch([stored([100 + seq], 99 + seq if seq else None)], ts=2000.0 + seq),
                  live=False)


def test_a_restart_hidden_in_a_gap_is_rebuilt_from_the_new_lifetime(fake):
    a = Attachment(fake.endpoint, fake.replay_endpoint, replay_timeout_s=2.0)
    try:
        fake.wait_subscribed()
        fake.send(0, batch([stored([1, 2], None)]))
        fake.send(1, batch([stored([3], 2)]))
        drain(a, 1)
        new_lifetime(fake, 5)  # more batches than the old lifetime had: the sequence only rose
        fake.send(5, batch([stored([105], 104)], ts=2005.0))
        drain(a, 5)
        assert fake.replay_requests == [1, 0]  # the check at 1 failed: all of the new lifetime
        assert a.mirror.tree() == {100: None, 101: 100, 102: 101, 103: 102, 104: 103, 105: 104}
        h = a.health
        assert (h.restarts, h.gaps, h.lost, h.orphans) == (1, 0, 0, 0)
        assert "publisher restarted (a gap after sequence 1" in h.notes[-1]
    finally:
        a.close()


def test_a_replay_that_no_longer_has_the_last_batch_applied_is_a_new_lifetime(fake):
    a = Attachment(fake.endpoint, fake.replay_endpoint, replay_timeout_s=2.0)
    try:
        fake.wait_subscribed()
        fake.send(0, batch([stored([1], None)]))
        drain(a, 0)
        new_lifetime(fake, 4)
        with fake._lock:
            del fake.buffer[:2]  # its buffer starts at 2: batch 0 is gone, later ones are not
        fake.send(4, batch([stored([104], 103)], ts=2004.0))
        drain(a, 4)
        assert set(a.mirror.tree()) == {102, 103, 104} and a.health.restarts == 1
        assert a.health.orphans == 1  # the new lifetime's history before its buffer
    finally:
        a.close()


def test_a_drop_says_so_until_the_replay_answers_and_what_it_missed_comes_back(fake, proxy):
    a = Attachment(proxy.endpoint, fake.replay_endpoint, replay_timeout_s=2.0)
    try:
        fake.wait_subscribed()
        fake.send(0, batch([stored([1], None)]))
        drain(a, 0)
        assert not missed(a) and not a.unsure
        proxy.down()
        poll_until(a, lambda: missed(a))
        assert a.health.lines()[0].endswith(f"may have missed batches since a disconnect from "
                                            f"{proxy.endpoint} (until a replay answers)")
        assert a.health.lines()[3].endswith("disconnects: 1")
        fake.send(1, batch([stored([2], 1)]), live=False)  # published while cut off
        proxy.up()
        poll_until(a, lambda: not a.unsure)
        assert a.last == 1 and a.mirror.tree() == {1: None, 2: 1}
        h = a.health
        assert (h.gaps, h.repaired, h.missing, h.restarts) == (1, 1, 1, 0)
        assert fake.replay_requests == [0]  # from the last batch applied: the restart check
        assert "no batches missed" not in h.lines()[0] and not missed(a)
    finally:
        a.close()


def test_without_replay_the_next_live_sequence_settles_a_drop(fake, proxy):
    a = Attachment(proxy.endpoint, None)
    try:
        fake.wait_subscribed()
        fake.send(0, batch([stored([1], None)]))
        drain(a, 0)
        proxy.down()
        poll_until(a, lambda: missed(a))
        proxy.up()
        poll_until(a, lambda: a.reconnected)
        assert missed(a)  # reconnected, but nothing says what was missed yet
        wait_resubscribed(fake, a)
        fake.send(1, batch([stored([2], 1)]))
        drain(a, 1)
        assert not missed(a) and a.health.gaps == 0  # the sequence went on
        proxy.down()
        poll_until(a, lambda: missed(a))
        fake.send(2, batch([stored([3], 2)]), live=False)
        proxy.up()
        wait_resubscribed(fake, a)
        fake.send(3, batch([stored([4], 3)]))
        drain(a, 3)
        h = a.health
        assert not missed(a) and (h.gaps, h.lost, h.disconnects) == (1, 1, 2)
    finally:
        a.close()


def test_a_replay_that_does_not_answer_after_a_reconnect_is_asked_again(fake, proxy,
                                                                        monkeypatch):
    monkeypatch.setattr(subscriber, "RESYNC_RETRY_S", 0.2)
    replay = TcpProxy(int(fake.replay_endpoint.rpartition(":")[2]))
    a = Attachment(proxy.endpoint, replay.endpoint, replay_timeout_s=0.3)
    try:
        fake.wait_subscribed()
        fake.send(0, batch([stored([1], None)]))
        drain(a, 0)
        replay.down()
        proxy.down()
        poll_until(a, lambda: missed(a))
        fake.send(1, batch([stored([2], 1)]), live=False)
        proxy.up()
        poll_until(a, lambda: "did not finish its reply" in a.health.notes[-1])
        assert missed(a) and a.reconnected
        replay.up()
        poll_until(a, lambda: not missed(a))  # asked again, and answered
        assert a.last == 1 and a.health.repaired == 1
    finally:
        a.close()
        replay.close()

