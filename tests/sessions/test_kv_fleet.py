"""A fleet attached at once over real sockets: two `kvscope serve --kv-events` processes and a fake
publisher; each instance's mirror equals its engine's cache at the end (digests compared), a
publisher killed and restarted mid-run is a restart of that instance only, the fleet index says
which instances hold a block, and everything is recorded to one session."""

import shutil
import tempfile
import time

import pytest
from kv_fake_publisher import FakePublisher, batch, removed, stored
from kv_serve import finish, serve_kv_events

from kvscope.sessions import SessionReader
from kvscope.sessions.kv_events.fleet import (
    FleetIndex,
    Instance,
    cache_digest,
    mirror_digest,
    parse_endpoint_option,
    parse_instance,
    read_fleet,
)
from kvscope.sessions.kv_events.fleet_session import FleetSession
from kvscope.sessions.kv_events.mirror import Mirror
from kvscope.sessions.kv_events.slots import read_instance_detail
from kvscope.sessions.kv_events.wire import Batch, Stored


def wait_for(cond, timeout_s=30.0, what=""):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.05)


def wait_exit(served, timeout_s=60):
    served.proc.wait(timeout=timeout_s)
    finish(served)


def keys_of(mirror, rank):
    return {(g, m, h) for r, g, m, h in mirror.blocks if r == rank}


@pytest.fixture
def ipc_dir():
    d = tempfile.mkdtemp(prefix="kvf", dir="/tmp")  # ipc paths must be short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_three_publishers_attached_at_once(ipc_dir, tmp_path):
    pub_a, rep_a = f"ipc://{ipc_dir}/a.pub", f"ipc://{ipc_dir}/a.rep"
    fake = FakePublisher()
    path = tmp_path / "fleet.kvscope"
    with serve_kv_events(5, endpoint=pub_a, replay=rep_a) as a1, \
            serve_kv_events(5) as c:
        fleet = [Instance("a", pub_a, rep_a), Instance("b", fake.endpoint, fake.replay_endpoint),
                 Instance("c", c.endpoint, c.replay)]
        s = FleetSession(fleet, record=str(path), num_slots=256, tick_s=0.05,
                         replay_timeout_s=2.0).start()
        try:
            fake.wait_subscribed(timeout_s=10)
            m = s.mirror
            # a runs its workload, and is killed after it (while it waits): mid-run for the fleet
            line = ""
            while not line.startswith("published"):
                line = a1.proc.stdout.readline() or "published ? batches"
            batches = int(line.split()[1])
            wait_for(lambda: s.attachments[0].last == batches - 1, timeout_s=60,
                     what=f"a's {batches} batches")
            a1.proc.kill()
            a1.proc.wait()
            wait_exit(c)
            wait_for(lambda: s.attachments[2].last == c.batches - 1, what="c's last batch")
            c_keys = keys_of(m, 2)
            x = sorted(h for _, _, h in c_keys)[0]  # a block c holds: b stores it too
            fake.send(0, batch([stored([x], None), stored([5, 6], None)]))
            fake.send(1, batch([removed([6])]))
            with serve_kv_events(1, endpoint=pub_a, replay=rep_a) as a2:
                wait_exit(a2)
                wait_for(lambda: s.attachments[0].last == a2.batches - 1, what="a's new life")
                wait_for(lambda: s.attachments[1].last == 1, what="b's batches")
                time.sleep(0.3)  # a few ticks
        finally:
            s.stop()
            fake.close()
    # each instance's mirror equals its engine's cache at the end
    assert mirror_digest(m, 0) == a2.cache
    assert mirror_digest(m, 1) == cache_digest({(0, "GPU", x), (0, "GPU", 5)})
    assert mirror_digest(m, 2) == c.cache
    # the restart is a's alone
    assert [r.restarts for r in s.rows] == [1, 0, 0]
    assert [r.name for r in s.rows] == ["a", "b", "c"]
    assert s.rows[1].ok is True and s.rows[0].ok is False
    assert [r.resident for r in s.rows] == [len(keys_of(m, r)) for r in range(3)]
    # the index: who holds x, a block only b holds, one b removed
    want = {n for r, n in enumerate("abc") if (0, "GPU", x) in keys_of(m, r)}
    assert want >= {"b", "c"}
    assert set(s.index.holders(0, x)) == want
    assert s.index.holders(0, 5) == {"b": {"GPU"}} and s.index.holders(0, 6) == {}
    chain = s.index.chain_to(max((k for k in m.blocks if k[0] == 2), key=lambda k: (
        len(s.index.chain_to(k)), repr(k))))
    held = s.index.prefix_held(chain)
    assert held["c"] == len(chain) >= 2 and held["b"] == (1 if chain[0] == x else 0)
    # one session, instances as ranks, names kept
    with SessionReader(path) as reader:
        assert reader.meta.engine_config["instances"] == ["a", "b", "c"]
        end = reader.snapshot_at(reader.last_step)
        assert end.num_cached_blocks == m.num_resident == sum(r.resident for r in s.rows)
        # each stored block's event names its instance, and a's restart is recorded, a's alone
        named = [read_instance_detail(e.detail)
                 for e in reader.events_between(reader.first_step, reader.last_step)]
        assert {name for name, restart in named if name and not restart} == {"a", "b", "c"}
        assert [x for x in named if x[1]] == [("a", 1)]


def test_the_index_scores_prefixes_per_group_and_tier():
    m = Mirror()
    m.apply(Batch(0.0, [Stored([1, 2, 3], None, [], 4, "GPU")], 0))
    m.apply(Batch(0.0, [Stored([1, 2], None, [], 4, "GPU"),
                        Stored([3], 2, [], 4, "CPU")], 1))
    m.apply(Batch(0.0, [Stored([1, 2, 3], None, [], 4, "GPU", group=1)], 2))
    index = FleetIndex(m, ["a", "b", "c"])
    assert index.holders(0, 3) == {"a": {"GPU"}, "b": {"CPU"}}
    assert index.holders(1, 3) == {"c": {"GPU"}}
    assert index.prefix_held([1, 2, 3]) == {"a": 3, "b": 2, "c": 0}
    assert index.prefix_held([1, 2, 3], group=1)["c"] == 3
    assert index.chain_to((0, 0, "GPU", 3)) == [1, 2, 3]


def test_fleet_lines_and_options_are_checked(tmp_path):
    assert parse_instance(["a", "tcp://h:5557", "-", "http://h:8000/metrics"]) == \
        Instance("a", "tcp://h:5557", None, "http://h:8000/metrics")
    assert parse_endpoint_option("b=tcp://h:1,tcp://h:2") == Instance("b", "tcp://h:1",
                                                                       "tcp://h:2")
    f = tmp_path / "fleet.txt"
    f.write_text("# the fleet\na tcp://h:1 tcp://h:2\n\nb tcp://h:3 # no replay\n")
    assert [i.name for i in read_fleet(f)] == ["a", "b"]
    for line, why in (("a", "needs a name and an endpoint"),
                      ("a h:1", "is not a ZMQ address"),
                      ("a tcp://h:1 ftp://x", "neither a replay endpoint"),
                      ("a b c d e", "at most 4"),
                      ("a/b tcp://h:1", "name 'a/b'")):
        f.write_text(f"ok tcp://h:9\n{line}\n")
        with pytest.raises(ValueError, match=why) as e:
            read_fleet(f)
        assert "line 2" in str(e.value) and "\n" not in str(e.value)
