"""kvscope attach against vLLM's own parts, end to end: vLLM 0.33's KVCacheManager makes the
events from chat traffic (shared prefixes, multi-turn resends, decodes, eviction pressure), its
ZmqEventPublisher publishes them (PUB + replay ROUTER), and attach's mirror must hold what vLLM
holds: the same blocks stored, removed and resident, and the same resident hashes with the same
copies (vLLM's block_pool.cached_block_hash_to_block, and VllmSide.resident by content) -
attached from the start, mid-stream, late, across a reset, a publisher restart, a dropped
connection, a restart inside a drop, and a drop with nothing published after it.

Drops go through a TCP proxy between the publisher and attach (the replay endpoint is direct).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import vllm_ref as vr
from traffic import multi_turn, play
from vllm_server import VllmServer

from kvscope.sessions.kv_events import Attachment

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sessions"))
from tcp_proxy import TcpProxy  # noqa: E402

NUM_BLOCKS = 32  # small enough that the traffic evicts
_rids = itertools.count()  # request ids stay unique over a test's phases


@pytest.fixture
def server():
    s = VllmServer(num_blocks=NUM_BLOCKS)
    yield s
    s.close()


@pytest.fixture
def proxy(server):
    p = TcpProxy(server.port)
    yield p
    p.close()


def traffic(server: VllmServer, seed: int, users: int = 4, turns: int = 3) -> None:
    """Chat traffic on the server's cache, one published batch per scheduler step."""
    reqs = [dataclasses.replace(r, rid=next(_rids)) for r in multi_turn(seed, users, turns)]
    play(server.side, reqs, on_step=lambda _: server.step())
    server.wait_published()


def attach(endpoint: str, server: VllmServer) -> Attachment:
    return Attachment(endpoint, server.replay, replay_timeout_s=2.0).start()


# ---------------------------------------------------------------------- the two states compared
def vllm_state(server: VllmServer) -> dict:
    """What vLLM published (all lifetimes) and what its block pool holds now: hash -> copies."""
    cached = server.side.manager.block_pool.cached_block_hash_to_block._cache
    copies = {vr.maybe_convert_block_hash(vr.get_block_hash(k)):
              1 if isinstance(v, vr.KVCacheBlock) else len(v) for k, v in cached.items()}
    return dict(stored=server.num_stored, removed=server.num_removed, resident=len(copies),
                hashes=copies)


def attach_state(att: Attachment) -> dict:
    m = att.mirror
    assert {k[:3] for k in m.blocks} <= {(0, 0, "GPU")}
    hashes = {k[3]: entry[0] for k, entry in m.blocks.items()}
    return dict(stored=m.num_stored, removed=m.num_removed, resident=m.num_resident,
                hashes=hashes)


def wait_until(att: Attachment, condition, timeout_s: float = 5.0) -> bool:
    """Poll the attachment until condition() holds; False if it does not in time."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        att.poll(10)
    return True


def traffic_until_live(att: Attachment, server: VllmServer, seed: int) -> None:
    """After a reconnect: small rounds of traffic until attach receives one live (the
    subscription takes a moment to reach the publisher; what it misses before is replayed)."""
    before = att.num_messages
    for i in range(20):
        traffic(server, seed * 100 + i, users=1, turns=1)
        if wait_until(att, lambda: att.num_messages > before, 0.2):
            return
    raise AssertionError("nothing came live after the reconnect")


def assert_mirrors(att: Attachment, server: VllmServer, timeout_s: float = 5.0) -> None:
    """Attach catches up with vLLM (its last batch applied, the same state) within timeout_s."""
    wait_until(att, lambda: att.last == server.num_batches - 1 and
               attach_state(att) == vllm_state(server), timeout_s)
    assert attach_state(att) == vllm_state(server)
    assert att.last == server.num_batches - 1
    side = server.side  # and by content, on vLLM's own request-side view
    by_content = {side.name_of.get(h, ("not vLLM's", h)): n
                  for h, n in attach_state(att)["hashes"].items()}
    assert by_content == dict(side.resident)


def missed_batches(att: Attachment) -> bool:
    return any("may have missed batches" in line for line in att.health.lines())


def assert_clean(att: Attachment, restarts: int = 0) -> None:
    h = att.health
    assert (h.lost, h.orphans, h.unknown_removes, h.bad_messages) == (0, 0, 0, 0), h.notes
    assert h.restarts == restarts and h.repaired == h.gaps, list(h.notes)
    assert not missed_batches(att), h.lines()


def hold(seconds: float, since: float) -> None:
    """A connection drop lasts this long (the scenario's length, not a wait for a result)."""
    time.sleep(max(0.0, since + seconds - time.monotonic()))


# ---------------------------------------------------------------------- attached from ...
def test_attached_from_the_start_follows_vllm_live(server):
    att = Attachment(server.endpoint, server.replay, replay_timeout_s=2.0)
    try:
        assert wait_until(att, lambda: att.connected)
        att.start()  # nothing to replay; by its answer the subscription is in place
        traffic(server, 1)
        assert_mirrors(att, server)
        traffic(server, 2, users=6)
        assert_mirrors(att, server)
        assert server.num_removed > 0 and att.health.duplicate_stores > 0  # copies of a hash
        assert att.health.first_seq == {server.endpoint: 0}
        assert att.health.replayed == 0 and att.num_messages == server.num_batches  # all live
        assert_clean(att)
    finally:
        att.close()


def test_attached_mid_stream_gets_the_history_by_replay(server):
    traffic(server, 3)
    before = server.num_batches
    att = attach(server.endpoint, server)
    try:
        assert att.last == before - 1 and att.health.replayed == before > 0
        traffic(server, 4)
        assert_mirrors(att, server)
        assert att.health.first_seq == {server.endpoint: 0} and server.num_removed > 0
        assert_clean(att)
    finally:
        att.close()


def test_attached_late_gets_everything_by_replay(server):
    traffic(server, 5)
    traffic(server, 6)
    att = attach(server.endpoint, server)
    try:
        assert_mirrors(att, server, timeout_s=0.5)
        assert att.health.replayed == server.num_batches and att.health.gaps == 0
        assert_clean(att)
    finally:
        att.close()


def test_a_reset_clears_the_mirror_and_is_counted(server):
    att = attach(server.endpoint, server)
    try:
        traffic(server, 7)
        assert_mirrors(att, server)
        held = att.mirror.num_resident
        assert server.side.reset()  # vLLM resets only with no block in use: between phases
        server.step()
        server.wait_published()
        assert_mirrors(att, server)
        assert att.mirror.num_resident == 0 and att.mirror.num_cleared == held > 0
        traffic(server, 8)
        assert_mirrors(att, server)
        assert att.mirror.num_resets == server.num_resets == 1
        assert "resets (AllBlocksCleared): 1" in att.mirror.summary()
        assert_clean(att)
    finally:
        att.close()


def test_a_hybrid_model_is_mirrored_group_by_group():
    """vLLM with a full-attention group and a 24-token sliding window (its
    HybridKVCacheCoordinator): its stores name each group's kind and window, and the mirror
    holds, group by group, the hashes (and copies) vLLM's pool holds."""
    server = VllmServer(num_blocks=NUM_BLOCKS, windows=(24,))
    att = attach(server.endpoint, server)
    try:
        traffic(server, 11)
        traffic(server, 12, users=6)
        cached = server.side.manager.block_pool.cached_block_hash_to_block._cache
        theirs = {(vr.get_group_id(k), vr.maybe_convert_block_hash(vr.get_block_hash(k))):
                  1 if isinstance(v, vr.KVCacheBlock) else len(v) for k, v in cached.items()}
        wait_until(att, lambda: att.last == server.num_batches - 1)
        ours = {(k[1], k[3]): entry[0] for k, entry in att.mirror.blocks.items()}
        assert ours == theirs and {g for g, _ in theirs} == {0, 1}
        assert att.mirror.specs == {(0, 0): ("full_attention", None),
                                    (0, 1): ("sliding_window", 24)}
        assert server.num_removed > 0
        assert_clean(att)
    finally:
        att.close()
        server.close()


# ---------------------------------------------------------------------- what networks do
def test_a_publisher_restart_rebuilds_the_mirror(server):
    att = attach(server.endpoint, server)
    try:
        traffic(server, 9)
        assert_mirrors(att, server)
        server.restart()  # a new process: an empty cache, sequences from 0
        traffic(server, 10, users=2, turns=2)
        assert_mirrors(att, server)
        assert_clean(att, restarts=1)
    finally:
        att.close()


def test_a_dropped_connection_is_noticed_and_repaired(server, proxy):
    att = attach(proxy.endpoint, server)
    try:
        traffic(server, 11)
        assert_mirrors(att, server)
        t0 = time.monotonic()
        proxy.down()
        noticed = wait_until(att, lambda: missed_batches(att), 1.0)  # asserted after the state
        traffic(server, 12)  # published while attach is cut off
        hold(1.5, t0)
        proxy.up()
        traffic_until_live(att, server, 13)  # attach is back: the gap shows on the live stream
        assert_mirrors(att, server)
        assert noticed, "the drop did not say 'may have missed batches'"
        h = att.health
        assert h.disconnects == 1 and h.gaps >= 1 and h.missing > 0
        assert_clean(att)
    finally:
        att.close()


def test_a_restart_inside_a_drop_is_a_new_lifetime(server, proxy):
    """The issue's case: the publisher restarts while attach is cut off and publishes more
    batches than its old lifetime had; attach must not splice the new lifetime's batches onto
    the old one's."""
    att = attach(proxy.endpoint, server)
    try:
        traffic(server, 14, users=1, turns=2)
        assert_mirrors(att, server)
        old = server.num_batches
        t0 = time.monotonic()
        proxy.down()
        server.restart()
        traffic(server, 15, users=5)
        assert server.num_batches > old  # what hides the restart: the sequence only goes up
        hold(2.5, t0)
        proxy.up()
        traffic_until_live(att, server, 16)  # live: a sequence past the old lifetime's last
        assert_mirrors(att, server)
        assert_clean(att, restarts=1)
        assert any("restarted" in n for n in att.health.notes)
    finally:
        att.close()


def test_batches_lost_at_the_end_of_a_drop_are_recovered(server, proxy):
    """Published while cut off, with nothing after them: only the reconnect can tell."""
    att = attach(proxy.endpoint, server)
    try:
        traffic(server, 17)
        assert_mirrors(att, server)
        t0 = time.monotonic()
        proxy.down()
        noticed = wait_until(att, lambda: missed_batches(att), 1.0)  # asserted after the state
        traffic(server, 18)
        hold(1.0, t0)
        proxy.up()
        assert_mirrors(att, server)
        assert noticed, "the drop did not say 'may have missed batches'"
        h = att.health
        assert h.gaps == h.repaired == 1 and h.missing > 0
        assert_clean(att)
    finally:
        att.close()


# ---------------------------------------------------------------------- as a user runs it
def test_headless_cli_mirrors_vllm_across_history_a_reset_and_a_drop_at_the_end(server, proxy):
    traffic(server, 19)  # history: published before attach
    assert server.side.reset()
    server.step()
    proc = subprocess.Popen([sys.executable, "-m", "kvscope.app", "attach", proxy.endpoint,
                             "--replay", server.replay, "--headless", "--duration", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        proxy.wait_accepted(1)  # it is up and subscribing
        traffic(server, 20)
        proxy.down()
        traffic(server, 21)  # while cut off, and nothing after it
        time.sleep(0.5)  # the drop's length
        proxy.up()
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, err
    want = vllm_state(server)
    last = out.splitlines()[-1]
    m = re.fullmatch(r"blocks stored: (\d+), removed: (\d+), resident: (\d+), gaps: (\d+), "
                     r"repaired: (\d+), orphans: 0, restarts: 0", last)
    assert m, last
    assert [int(x) for x in m.groups()[:3]] == [want["stored"], want["removed"],
                                                want["resident"]], out
    assert m[4] == m[5] != "0"  # the drop's batches came back through replay
    assert "resets (AllBlocksCleared): 1" in out and "disconnects: 1" in out
    gaps = next(line for line in out.splitlines() if line.startswith("  gaps: "))
    assert "0 batches lost" in gaps and "may have missed" not in gaps, gaps
