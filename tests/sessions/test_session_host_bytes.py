"""A session of an engine with a host tier records the KV bytes per token (metadata) and the
tier's running totals (CacheCounters' host fields, steps columns): its replay gives each step the
bytes the live run moved and the counters the live engine published. A session recorded before
either was kept opens: host counters 0, bytes not known."""

from __future__ import annotations

from pathlib import Path

import pytest
from session_testutil import drive, make_engine

from kvscope.sessions import Recorder, SessionReader
from kvscope.sessions.schema import TOTALS

DATA = Path(__file__).resolve().parents[1] / "data"
HOST_FIELDS = ("host_hit_tokens", "num_offloaded_blocks", "num_loaded_blocks",
               "num_host_evicted_blocks")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, tiny_model_dir):
    """(session, the live run's bytes moved per step, its counters per step)."""
    engine = make_engine(tiny_model_dir, host_blocks=24)
    block_bytes = engine.runner.kv_cache[:, :, 0].nbytes  # one block: every layer, K and V
    counters = {}
    engine.subscribe(lambda u: counters.__setitem__(u.record.step, u.counters))
    path = tmp_path_factory.mktemp("host_bytes") / "host.kvscope"
    with Recorder(path, engine):
        drive(engine, max_steps=120)
    moved = {r.step: (r.offloaded_blocks * block_bytes, r.loaded_blocks * block_bytes)
             for r in engine.step_records}
    return path, moved, counters


def test_replayed_bytes_equal_the_live_runs(recorded):
    path, moved, _ = recorded
    assert sum(o for o, _ in moved.values()) > 0 and sum(i for _, i in moved.values()) > 0
    with SessionReader(path) as r:
        per_block = r.meta.block_bytes
        replayed = {s.step: (s.offloaded_blocks * per_block, s.loaded_blocks * per_block)
                    for s in r.steps()}
    assert replayed == moved


def test_replayed_counters_per_tier_equal_the_live_engines(recorded):
    path, _, live = recorded
    last = live[max(live)]
    assert last.num_offloaded_blocks > 10 and last.num_loaded_blocks > 3
    assert last.host_hit_tokens > 0 and last.num_host_evicted_blocks > 0
    with SessionReader(path) as r:
        for step in r.step_numbers:  # (from keyframes and from the events after them)
            assert r.snapshot_at(step).counters == live[step], step


@pytest.mark.parametrize("name", ["session_before_step_stream.kvscope",
                                  "session_before_typed_events.kvscope"])
def test_a_session_from_before_opens_with_zero_host_counters_and_no_bytes(tmp_path, name):
    copy = tmp_path / name
    copy.write_bytes((DATA / name).read_bytes())
    with SessionReader(copy) as r:
        assert not {TOTALS[f] for f in HOST_FIELDS} & set(r.step_table()[0])  # from before
        assert r.meta.kv_bytes_per_token is None and r.meta.block_bytes is None
        snaps = [r.snapshot_at(s) for s in r.step_numbers]  # keyframes and the steps between
        assert all(getattr(s.counters, f) == 0 for s in snaps for f in HOST_FIELDS)
        assert snaps[-1].counters.hit_tokens > 0  # the totals the file has are read
        assert r.verify() == []


def test_the_lab_on_the_session_reports_bytes_moved_by_its_models_blocks(recorded, capsys):
    """`kvscope lab SESSION --host-blocks`: a session knows its model's KV bytes, so the tier
    rows move bytes without --kv-bytes-per-token."""
    from kvscope.app.cli import main as cli
    from kvscope.lab import report
    from kvscope.lab.capacity import format_bytes
    from kvscope.sessions.lab_input import load_lab_input

    path = recorded[0]
    with SessionReader(path) as r:
        block_bytes, bs = r.meta.block_bytes, r.meta.block_size
    rows, _ = report.run(load_lab_input(path), [8], ["lru"], bs, host_sizes=(32,),
                         on_row=lambda row: None)
    tiered = rows[1]
    assert tiered.host_blocks == 32 and tiered.offloaded_blocks and tiered.loaded_blocks
    assert cli.main(["lab", str(path), "--block-size", str(bs), "--pool-blocks", "8",
                     "--host-blocks", "32", "--policy", "lru"]) == 0
    out = capsys.readouterr().out
    assert f"bytes moved ({block_bytes:,} a block)" in out
    assert (f"offloaded {format_bytes(tiered.offloaded_blocks * block_bytes)}, "
            f"loaded {format_bytes(tiered.loaded_blocks * block_bytes)})") in out


def test_the_run_summary_gives_the_bytes_the_tiers_moved(tiny_model_dir):
    """`kvscope run`'s summary line of a host tier: blocks and their bytes each way."""
    import json

    from kvscope.app.cli.run import format_summary
    from kvscope.lab.capacity import format_bytes
    from kvscope.lab.workload import parse_workload
    from kvscope.lab.workload_run import WorkloadRunner, summarize

    engine = make_engine(tiny_model_dir, num_blocks=12, host_blocks=32)
    block_bytes = engine.runner.kv_cache[:, :, 0].nbytes
    a, b = list(range(3, 35)), list(range(40, 80))  # 8 and 10 blocks: b evicts a
    lines = [{"prompt_ids": p, "max_tokens": 2, "ignore_eos": True} for p in (a, b, a)]
    result = WorkloadRunner(engine, parse_workload("\n".join(map(json.dumps, lines)))).run()
    off = sum(r.offloaded_blocks for r in engine.step_records)
    load = sum(r.loaded_blocks for r in engine.step_records)
    assert off > 1 and load > 1
    text = format_summary(summarize(engine, result))
    assert (f"{off} blocks ({format_bytes(off * block_bytes)}) copied there, "
            f"{load} blocks ({format_bytes(load * block_bytes)}) back, in ") in text


def test_a_fractional_bytes_per_token_reads_back(recorded, tmp_path):
    """A sub-byte KV format's bytes per token (int4: a fraction) is kept as it is."""
    import sqlite3

    copy = tmp_path / "frac.kvscope"
    copy.write_bytes(recorded[0].read_bytes())
    with sqlite3.connect(copy) as conn:
        conn.execute("UPDATE session SET kv_bytes_per_token = 0.5625")
    with SessionReader(copy) as r:
        assert r.meta.kv_bytes_per_token == 0.5625
        assert r.meta.block_bytes == round(0.5625 * r.meta.block_size)
