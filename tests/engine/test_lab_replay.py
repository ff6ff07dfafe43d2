"""The lab's step-by-step what-if replay (kvscope.lab.replay): any step's pool from the nearest
checkpoint is the pool a replay from the start reaches; its hits are whatif.replay's; the pass
reports progress and stops when cancelled."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from kvscope.lab import whatif
from kvscope.lab.replay import WhatIfReplay
from kvscope.lab.traces import load_trace

HEAD = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_head200.jsonl"
FIELDS = ("state", "ref_count", "owner", "block_hash", "parent_hash", "lru_rank", "last_use",
          "hit_count", "cached_seq")


def run(size: int, policy: str, every: int | None = None, n: int = 80) -> WhatIfReplay:
    replay = WhatIfReplay(load_trace(HEAD, limit=n), size, 16, policy)
    if every is not None:
        replay.checkpoint_every = every
    assert replay.run()
    return replay


@pytest.mark.parametrize("size, policy", [(300, "fifo"), (2_000, "lru"), (1_000, "lfu")])
def test_any_step_from_a_checkpoint_is_the_step_replayed_from_the_start(size, policy):
    sparse, dense = run(size, policy, every=10**6), run(size, policy, every=3)
    assert len(dense._checkpoints) > 10 and len(sparse._checkpoints) == 1
    steps = random.Random(size).sample(range(80), 20)
    for step in steps + [79, 0, 40, 41, 42]:  # the end, the start, on and on
        a, b = sparse.state_at(step), dense.state_at(step)
        for name in FIELDS:
            assert np.array_equal(getattr(a.snapshot, name), getattr(b.snapshot, name)), name
        assert a.snapshot.counters == b.snapshot.counters == dense.counters[step]
        assert [(e.kind, e.blocks) for e in a.events] == [(e.kind, e.blocks) for e in b.events]
        assert np.array_equal(a.dead, b.dead)
        assert a.snapshot.block_tables.keys() == ({step} if step in dense.cached else set())
    whole = whatif.replay(load_trace(HEAD, limit=80), size, 16, policy)
    assert sum(dense.cached.values()) == whole.hit_tokens
    i = max(dense.cached)  # admitted: explained from its step on
    assert dense.explanation(i, i - 1) is None and dense.explanation(i, i).request_id == i


def test_the_pass_reports_progress_and_stops_when_cancelled():
    seen = []
    replay = WhatIfReplay(load_trace(HEAD, limit=50), 500, 16, "lru")
    assert not replay.run(lambda done, n: seen.append((done, n)), lambda: len(seen) >= 3)
    assert not replay.done and seen[-1][0] < 50
    with pytest.raises(RuntimeError):
        replay.state_at(0)
    seen.clear()
    replay = WhatIfReplay(load_trace(HEAD, limit=50), 500, 16, "lru")
    assert replay.run(lambda done, n: seen.append((done, n)))
    assert seen[-1] == (50, 50) and len(replay.records) == 50
    with pytest.raises(IndexError):
        replay.state_at(50)
