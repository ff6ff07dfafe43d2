"""BlockPool.clone (what replay seeks restart from): an independent pool that makes the same
choices as the original under every eviction policy."""

import random

import pytest

from kvscope.engine.block_pool import BlockPool


def drive(pool: BlockPool, seed: int, steps: int = 300) -> list:
    """Random allocations, hashes, hits and releases; returns every choice the pool made."""
    rng = random.Random(seed)
    held: list[list[int]] = []
    made = []
    for step in range(steps):
        if held and (rng.random() < 0.4 or pool.num_available < 4):
            blocks = held.pop(rng.randrange(len(held)))
            pool.release(blocks[::-1], step)
        else:
            blocks, evicted = pool.allocate(rng.randrange(1, 4), step)
            made.append((blocks, evicted))
            for b in blocks:
                pool.cache(b, rng.randbytes(8), b"root")
            held.append(blocks)
        cached = [b for b in pool.eviction_order() if pool.block_hash[b] is not None]
        if cached and rng.random() < 0.3:
            hit = [rng.choice(cached)]
            pool.take(hit, step, hit=True)
            held.append(hit)
        made.append(pool.eviction_order())
    return made


@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu"])
def test_a_clone_is_independent_and_chooses_as_the_original(policy):
    pool = BlockPool(24, eviction_policy=policy)
    drive(pool, seed=1)
    before = (pool.eviction_order(), pool.ref_count[:], dict(pool.hash_to_block))
    twin = pool.clone()
    assert drive(twin, seed=2) == drive(pool, seed=2)  # the same choices from the same state
    assert twin.eviction_order() == pool.eviction_order()
    fresh = BlockPool(24, eviction_policy=policy)
    drive(fresh, seed=1)
    other = fresh.clone()
    drive(other, seed=3)  # the clone moves on; the original stays as it was
    assert (fresh.eviction_order(), fresh.ref_count, fresh.hash_to_block) == before
