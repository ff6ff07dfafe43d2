"""An attached session records to a .kvscope file that replays like any other, and scrapes the
server's Prometheus metrics beside the events."""

import subprocess
import sys
import time

import numpy as np
import pytest
from kv_fake_publisher import FakePublisher, batch, cleared, removed, stored
from kv_metrics_server import VLLM_METRICS, MetricsServer

from kvscope.app.prefix_tree import _parent_blocks
from kvscope.engine import events as ev
from kvscope.sessions import SessionReader
from kvscope.sessions.kv_events.metrics import MetricsError, MetricsScraper, delta, parse_metrics
from kvscope.sessions.kv_events.session import AttachSession


def wait_for(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def same_tree(a, b) -> bool:
    """Same cells in the same states hanging under the same cells (hashes may be keyed)."""
    return np.array_equal(a.state, b.state) and np.array_equal(_parent_blocks(a),
                                                               _parent_blocks(b))


def test_an_attached_session_records_and_replays_the_mirror(tmp_path):
    path = tmp_path / "attached.kvscope"
    fake = FakePublisher()
    session = AttachSession(fake.endpoint, fake.replay_endpoint, record=str(path),
                            num_slots=64, tick_s=0.05).start()
    try:
        fake.wait_subscribed(timeout_s=10)
        fake.send(0, batch([stored([1, 2, 3], None), stored([11, 12], None, medium="CPU")]))
        fake.send(1, batch([stored([4, 5], 3), removed([12], medium="CPU")]))
        wait_for(lambda: session.mirror.num_removed == 1)
        time.sleep(0.15)  # a few ticks apart
        fake.send(2, batch([removed([5, 4])]))
        fake.send(3, batch([stored([6], 3), stored([7, 8], None, group=1)]))
        wait_for(lambda: session.mirror.num_stored == 10)
        time.sleep(0.15)
        mid_step, mid = session.latest.step, session.latest
        fake.send(4, batch([cleared()]))
        fake.send(5, batch([stored([20, 21], None)]))
        wait_for(lambda: session.mirror.num_stored == 12)
        time.sleep(0.15)
    finally:
        session.stop()
        fake.close()
    m, live = session.mirror, session.latest
    assert m.num_resident == live.num_cached_blocks == 2
    with SessionReader(path) as reader:
        assert reader.meta.model_name.startswith("attached: tcp://")
        assert reader.meta.block_size == 4 and reader.meta.num_blocks == 64
        assert same_tree(reader.snapshot_at(mid_step), mid)
        end = reader.snapshot_at(reader.last_step)
        assert same_tree(end, live) and end.num_cached_blocks == 2
        assert end.counters.num_evicted_blocks == m.num_removed == 3
        events = reader.events_between(reader.first_step, reader.last_step)
    stored_blocks = sum(len(e.blocks) for e in events if e.kind == ev.CACHED)
    assert stored_blocks == m.num_stored == 12  # no duplicates: one slot per store
    # the mid-run tree: 1-2-3 with 6 under 3 (4, 5 removed), 7-8 in group 1; 11 on the CPU
    # tier's own slots
    assert mid.num_cached_blocks == 6 and mid.medium == "GPU"
    assert (mid.host.medium, mid.host.num_cached_blocks) == ("CPU", 1)
    # chains from one root in group 0's tree, one in group 1's
    assert [int((_parent_blocks(mid, g) == -1).sum()) for g in (0, 1)] == [1, 1]


def test_metrics_are_parsed_summed_and_differenced():
    p = parse_metrics(VLLM_METRICS)
    assert (p.queries, p.hits, p.preemptions, p.kv_usage) == (1000, 250, 3, 0.42)
    assert p.ttft == (0.5, 4.0) and p.itl == (0.2, 10.0)
    later = parse_metrics(VLLM_METRICS.replace("} 1000.0", "} 1600.0")
                          .replace("count{engine=\"0\",model_name=\"m\"} 4.0",
                                   "count{engine=\"0\",model_name=\"m\"} 6.0")
                          .replace("sum{engine=\"0\",model_name=\"m\"} 0.5",
                                   "sum{engine=\"0\",model_name=\"m\"} 0.9"))
    d = delta(p, later)
    assert d["queries"] == 600 and d["hits"] == 0 and d["kv_usage"] == 0.42
    assert d["ttft"] == pytest.approx(0.2)  # (0.9 - 0.5) / (6 - 4)
    with pytest.raises(MetricsError, match="not Prometheus text format"):
        parse_metrics("this is { not metrics")


def test_sglang_metrics_give_its_hit_rate_usage_and_retractions():
    page = """\
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.28
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="m"} 0.5
# TYPE sglang:num_retracted_reqs gauge
sglang:num_retracted_reqs{model_name="m",pid="7"} 1.0
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{model_name="m"} 48.0
# TYPE sglang:inter_token_latency_seconds histogram
sglang:inter_token_latency_seconds_bucket{le="+Inf",model_name="m"} 4.0
sglang:inter_token_latency_seconds_sum{model_name="m"} 0.1
sglang:inter_token_latency_seconds_count{model_name="m"} 4.0
"""
    p = parse_metrics(page)
    assert (p.kv_usage, p.hit_rate, p.preemptions, p.itl) == (0.28, 0.5, 48, (0.1, 4.0))
    assert p.queries is None and p.ttft is None


def test_unreachable_or_garbage_metrics_give_one_line():
    scraper = MetricsScraper("http://127.0.0.1:9/metrics", timeout_s=1)
    assert scraper.poll() == {} and scraper.error.startswith("cannot read http://127.0.0.1:9")
    assert "\n" not in scraper.error
    server = MetricsServer("<html><body>hello</body></html>", b"\xff\xfe\x00")
    try:
        scraper = MetricsScraper(server.url)
        scraper.poll()
        first = scraper.error
        scraper.poll()
        assert first and scraper.error and "\n" not in first + scraper.error
    finally:
        server.close()


def test_headless_attach_with_metrics_and_record(tmp_path):
    server = MetricsServer()
    fake = FakePublisher()
    path = tmp_path / "a.kvscope"
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvscope.app", "attach", fake.endpoint, "--headless",
             "--duration", "2", "--metrics", server.url, "--record", str(path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        fake.wait_subscribed(timeout_s=10)
        fake.send(0, batch([stored([1, 2], None)]))
        fake.send(1, batch([removed([2])]))
        out, err = proc.communicate(timeout=30)
    finally:
        fake.close()
        server.close()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert ("metrics: prefix cache hits 250 of 1000 tokens (25.0%), KV usage 42.0%, "
            "preemptions 3, TTFT mean 125.0 ms over 4, ITL mean 20.0 ms over 10") in out
    assert f"recorded: {path}" in out
    assert out.splitlines()[-1].startswith("blocks stored: 2, removed: 1, resident: 1,")
    with SessionReader(path) as reader:
        snap = reader.snapshot_at(reader.last_step)
        assert snap.num_cached_blocks == 1 and snap.counters.num_evicted_blocks == 1
        assert snap.counters.query_tokens == 1000 and snap.counters.hit_tokens == 250


def test_headless_attach_with_unreachable_metrics_says_so_in_one_line():
    fake = FakePublisher()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvscope.app", "attach", fake.endpoint, "--headless",
             "--duration", "1", "--metrics", "http://127.0.0.1:9/metrics"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        fake.wait_subscribed(timeout_s=10)
        fake.send(0, batch([stored([1], None)]))
        out, err = proc.communicate(timeout=30)
    finally:
        fake.close()
    assert proc.returncode == 0 and "Traceback" not in err
    assert [ln for ln in err.splitlines() if "Metrics" in ln] == [
        ln for ln in err.splitlines() if ln.startswith("kvscope: Metrics: cannot read")]
    assert "metrics: cannot read http://127.0.0.1:9/metrics" in out


def test_more_resident_blocks_than_slots_still_record_and_replay(tmp_path):
    """The slot view keeps the newest blocks (the oldest are pushed out, counted as overflow),
    and the recording replays step by step to the same pool."""
    from kvscope.sessions.kv_events import Mirror
    from kvscope.sessions.kv_events.slots import HashSlots
    from kvscope.sessions.kv_events.wire import Batch, Removed, Stored
    from kvscope.sessions.recorder import Recorder

    mirror = Mirror()
    slots = HashSlots(mirror, num_slots=8)
    mirror.apply(Batch(0.0, [Stored([1], None, [], 4)]))
    rec = Recorder(tmp_path / "small.kvscope", slots).start()
    shown = []
    for i in range(6):
        mirror.apply(Batch(float(i), [Stored([10 * i + k for k in range(1, 4)], None, [], 4)]))
        if i % 2:
            mirror.apply(Batch(float(i), [Removed([10 * (i - 1) + 2])]))
        slots.tick(float(i), 0.25)
        shown.append(slots.snapshot())
    rec.close()
    assert mirror.num_resident == 15  # 18 hashes (1 stored twice), 3 removed
    assert shown[-1].num_cached_blocks == 8 and slots.num_overflow >= 15 - 8
    with SessionReader(tmp_path / "small.kvscope") as reader:
        for snap in shown:
            assert same_tree(reader.snapshot_at(snap.step), snap)
            assert np.array_equal(reader.snapshot_at(snap.step).lru_rank, snap.lru_rank)


def test_a_slot_says_what_the_server_holds_in_it():
    from kvscope.sessions.kv_events import Mirror
    from kvscope.sessions.kv_events.slots import HashSlots
    from kvscope.sessions.kv_events.wire import Batch, Stored

    mirror = Mirror()
    slots = HashSlots(mirror, num_slots=8)
    mirror.apply(Batch(0.0, [Stored([1, 2], None, [], 4, medium="CPU", lora_name="ad"),
                             Stored([2], 1, [], 4, medium="CPU", lora_name="ad"),
                             Stored([9], 77, [], 4, group=1)], dp_rank=1))
    slots.tick(0.0, 0.25)
    text = {k[3]: slots.describe(s, k[2]) for k, s in slots.slot_of.items()}
    assert text[1].startswith(f"CPU hash slot {slots.slot_of[(1, 0, 'CPU', 1)]}: hash ")
    assert text[1].endswith("dp rank 1 · KV group 0 · CPU · 4 tokens · first block of its "
                            "chain · only in CPU · LoRA ad, salt none")
    assert "parent 0000000000000001… · 2 copies (duplicate stores)" in text[2]
    assert "never seen (an orphan" in text[9] and "KV group 1 · GPU" in text[9]
    assert slots.describe(7) is None
