"""One lifecycle fold (engine/lifecycle.py) and one count of the pool's totals
(BlockPool.counts): what each consumer derives from them."""

from __future__ import annotations

import random

import numpy as np

from kvscope.engine import events as ev
from kvscope.engine.block_pool import BlockPool
from kvscope.engine.lifecycle import FINISHED, RUNNING, WAITING, Lifecycles
from kvscope.engine.snapshot import CacheCounters, Snapshot


def _event(kind, rid, *values):
    return ev.Event(kind, 0, rid, values=values)


def test_the_fold_moves_a_request_through_its_states():
    life = Lifecycles()
    a = life.apply(_event(ev.ARRIVED, 1, 40))
    assert (a.status, a.just_arrived, a.admitted) == (WAITING, True, False)
    life.apply(_event(ev.ADMITTED, 1, 32, 8))
    assert (a.status, a.cached_tokens, a.sampled, a.just_arrived) == (RUNNING, 32, False, False)
    life.apply(_event(ev.PREEMPTED, 1))
    life.apply(_event(ev.ADMITTED, 1, 0, 48))  # readmitted: the first admission's count stays
    assert (a.status, a.cached_tokens) == (RUNNING, 32)
    life.apply(_event(ev.FINISHED, 1, "error: boom"))
    assert (a.status, a.reason) == (FINISHED, "error: boom")
    assert life.apply(_event(ev.ADMITTED, 1, 0, 1)) is None  # finished stays finished
    assert life.apply(_event(ev.CACHED, 1)) is None and life.apply(_event(ev.ARRIVED, None)) \
        is None
    r = life.apply(_event(ev.REJECTED, 2, "empty prompt"))
    assert (r.status, r.reason, r.just_arrived) == (FINISHED, "rejected", False)


def test_a_forked_sample_starts_in_decode_and_outputs_give_the_finish_reason():
    class Out:
        def __init__(self, rid, tokens, finished=False, reason=None):
            self.request_id, self.token_ids = rid, tokens
            self.finished, self.finish_reason = finished, reason

    life = Lifecycles()
    child = life.arrive(5, parent_id=4)
    assert (child.status, child.sampled) == (RUNNING, True)
    parent = life.arrive(4)
    life.apply(_event(ev.ADMITTED, 4, 0, 10))
    assert life.output(Out(4, [1])) == (parent, False) and parent.sampled
    life.apply(_event(ev.FINISHED, 4, "error: boom"))
    assert life.output(Out(4, [1], True, "error")) == (parent, True)
    assert parent.reason == "error"  # the output's reason, as the live table shows it
    assert life.output(Out(4, [1], True, "error"))[1] is False  # once


def test_pool_counts_agree_with_the_blocks_states():
    rng = random.Random(3)
    pool = BlockPool(24)
    held: list[list[int]] = []
    for step in range(400):
        op = rng.random()
        if op < 0.45 and pool.num_available >= 3:
            got, _ = pool.allocate(rng.randint(1, 3), step)
            for b in got:
                if rng.random() < 0.6:
                    pool.cache(b, rng.randbytes(8), rng.randbytes(8))
            held.append(got)
        elif held:
            pool.release(held.pop(rng.randrange(len(held))), step)
        counts = pool.counts()
        ref = np.array(pool.ref_count)
        hashed = np.array([h is not None for h in pool.block_hash])
        assert counts.active == int((ref >= 1).sum())
        assert counts.cached == int((hashed & (ref == 0)).sum()) == pool.num_cached
        assert sum(counts) == 24 and pool.copy().counts() == counts
        snap = Snapshot.from_pool(pool, {}, {}, CacheCounters(), step, 16)
        assert (snap.num_free_blocks, snap.num_active_blocks, snap.num_cached_blocks) == counts
