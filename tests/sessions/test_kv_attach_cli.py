"""`kvscope attach --headless` as a user runs it: a real process against a fake publisher."""

import subprocess
import sys

from kv_fake_publisher import FakePublisher, batch, removed, stored
from kv_serve import finish, serve_kv_events

from kvscope.sessions.kv_events import Attachment


def run_attach(*args, timeout=30):
    return subprocess.Popen([sys.executable, "-m", "kvscope.app", "attach", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_headless_attach_prints_summary_health_and_the_counts_line():
    fake = FakePublisher()
    try:
        fake.send(0, batch([stored([1, 2, 3], None)]), live=False)  # history: replay only
        fake.send(1, batch([stored([4], 3)]), live=False)
        proc = run_attach(fake.endpoint, "--replay", fake.replay_endpoint, "--headless",
                          "--duration", "3", "--hash-check", "sha256")
        fake.wait_subscribed(timeout_s=10)
        fake.wait_replay_requests(1)  # its history was read: what follows is live
        fake.send(2, batch([removed([1])]))
        fake.send(3, b"\x00garbage")
        fake.send(4, batch([stored([5], 4)]), live=False)  # a gap, repaired by replay
        fake.send(5, batch([stored([9], 77)], layout="array"))  # an orphan
        out, err = proc.communicate(timeout=30)
    finally:
        fake.close()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    lines = out.splitlines()
    assert lines[-1] == ("blocks stored: 6, removed: 1, resident: 5, gaps: 1, repaired: 1, "
                         "orphans: 1, restarts: 0")
    assert "dp rank 0, KV group 0, GPU: 5 blocks, 20 tokens, 2 chain roots" in out
    assert "hash parity (sha256, seed given): 0 blocks match, 1 differ" in out  # fake hashes
    assert "bad messages: 1" in out and "sequence 3: payload is not a KV-event batch" in out


def test_an_endpoint_that_sends_nothing_is_reported_after_the_duration():
    proc = run_attach("tcp://127.0.0.1:9", "--headless", "--duration", "0.5")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "Traceback" not in err
    assert err.startswith("kvscope: no KV events from tcp://127.0.0.1:9 in 0.5 s")
    assert out.splitlines()[-1].startswith("blocks stored: 0,")


def test_bad_addresses_exit_2_with_one_line_headless_or_not():
    for args in (["nonsense", "--headless"], ["nonsense"],
                 ["tcp://127.0.0.1:9", "--metrics", "ftp://x/metrics", "--headless"]):
        proc = run_attach(*args)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 2 and len(err.strip().splitlines()) == 1, err


def test_kvscope_serve_publishes_what_kvscope_attach_mirrors():
    with serve_kv_events(1) as served:
        att = Attachment(served.endpoint, served.replay, replay_timeout_s=5.0).start()
        while served.proc.poll() is None:
            att.poll(50)
        att.poll(200)
        finish(served)
    batches, events = served.batches, served.events
    m, h = att.mirror, att.health
    assert att.last == batches - 1 and m.num_stored + m.num_removed == events
    assert m.num_removed > 0 and h.lost == 0 and h.orphans == 0 and h.bad_messages == 0
    att.close()
