"""Per-group step counters (StepRecord.group_blocks, window_freed_blocks): what a hybrid run
publishes, checked against the step's snapshot and events; recorded and read back; old files
read as one group."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from session_testutil import drive, make_engine

from kvscope.engine import events as ev
from kvscope.engine.block_pool import BlockPool
from kvscope.engine.kv_cache_manager import KVCacheManager
from kvscope.engine.kv_groups import NULL, KVGroup
from kvscope.engine.stream import StepQueue
from kvscope.sessions import Recorder, SessionReader
from kvscope.sessions.errors import CorruptSessionError

DATA = Path(__file__).resolve().parents[1] / "data"


def held_in_tables(snap) -> list[int]:
    """Blocks held in each group: the distinct blocks of the group's tables (nulls aside)."""
    groups = [snap.block_tables, *snap.more_tables]
    return [len({b for t in tables.values() for b in t.tolist() if b != NULL})
            for tables in groups]


def test_a_hybrid_runs_records_count_each_groups_blocks_and_the_windows_releases(
        tmp_path, hybrid_model_dir):
    engine = make_engine(hybrid_model_dir)
    tap = StepQueue()
    engine.subscribe(tap)
    snaps = []
    path = tmp_path / "hybrid.kvscope"
    with Recorder(path, engine, keyframe_every=7):
        drive(engine, on_step=lambda e: snaps.append(e.snapshot()))
    updates = tap.drain()
    assert len(updates) == len(snaps) == engine.num_steps
    for u, snap in zip(updates, snaps, strict=True):
        rec = u.record
        assert list(rec.group_blocks) == held_in_tables(snap), rec.step
        assert sum(rec.group_blocks) == rec.num_active_blocks
        released = [b for e in u.events if e.kind == ev.OUT_OF_WINDOW for b in e.blocks]
        assert rec.window_freed_blocks == len(released), rec.step
    freed = [u.record.window_freed_blocks for u in updates]
    assert sum(freed) > 10 and max(freed) >= 2  # the window let go of blocks, often
    # the window group holds fewer blocks than full attention once requests are long
    assert any(0 < u.record.group_blocks[1] < u.record.group_blocks[0] for u in updates)

    with SessionReader(path) as s:  # read back: the same series
        steps = s.steps()
        assert [r.group_blocks for r in steps] == [u.record.group_blocks for u in updates]
        assert [r.window_freed_blocks for r in steps] == freed
        cols, rows = s.step_table()  # what the CSV export writes: the numbers, spaced
        i = cols.index("group_blocks")
        assert rows[-1][i] == " ".join(map(str, updates[-1].record.group_blocks))


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("*.kvscope")))
def test_an_old_session_reads_as_one_group_without_window_releases(name):
    with SessionReader(DATA / name) as s:
        steps = s.steps()
        assert steps and all(r.group_blocks == () and r.window_freed_blocks == 0 for r in steps)


def test_a_damaged_group_column_is_refused_with_its_name(tmp_path, tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    path = tmp_path / "one.kvscope"
    with Recorder(path, engine):
        drive(engine, max_steps=6)
    with SessionReader(path) as s:  # one group: it holds every active block
        steps = s.steps()
        assert [r.group_blocks for r in steps] == [(r.num_active_blocks,) for r in steps]
        assert any(r.num_active_blocks for r in steps)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE steps SET group_blocks = 'x 3' WHERE step = 2")
    with SessionReader(path) as s, pytest.raises(CorruptSessionError, match="group_blocks"):
        s.steps()


def test_the_pools_held_count_per_group_follows_every_operation():
    """Random admissions, decodes, forks, frees and resets on a manager with a window group:
    after each, the pool's count per group equals the blocks with a reference, by group, read
    from its per-block lists; clones and a pool rebuilt from a snapshot keep it."""
    rng = random.Random(3)
    mgr = KVCacheManager(48, 2, groups=(KVGroup(), KVGroup(4), KVGroup(7)))
    live = []
    for i in range(400):
        op = rng.random()
        if live and op < 0.2:
            mgr.free(live.pop(rng.randrange(len(live))))
        elif live and op < 0.25:
            mgr.fork(rng.choice(live), 10_000 + i)
            live.append(10_000 + i)
        elif live and op < 0.6:
            r = rng.choice(live)
            mgr.append_token_ids(r, [rng.randrange(4)])
            if mgr.can_allocate(r, 1):
                mgr.allocate(r, 1)
            else:
                mgr.free(r)
                live.remove(r)
        elif op < 0.62:
            mgr.reset_prefix_cache()
        elif mgr.admit(i, [rng.randrange(3) for _ in range(rng.randrange(1, 14))]) is not None:
            live.append(i)
        pool = mgr.pool
        ref, group = np.array(pool.ref_count), np.array(pool.group)
        want = tuple(int(((ref > 0) & (group == g)).sum()) for g in range(3))
        assert pool.held_by_group(3) == want, i
        if i % 50 == 0:
            assert pool.clone().held_by_group(3) == want
            assert BlockPool.from_snapshot(mgr.snapshot()).held_by_group(3) == want
    assert mgr.group_counts()[0] == want
