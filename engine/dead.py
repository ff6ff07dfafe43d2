"""Dead cache: resident blocks that can never hit again because a block before them in their
chain is gone. A lookup walks a prompt's chain from the first block and stops at the first miss,
so everything below a missing ancestor is unreachable, yet holds pool space until evicted.

Works on a live pool and on a Snapshot alike: a block is reachable when its parent is a chain
root (`BlockPool.chain_roots`: the parent hashes of first blocks) or a reachable resident block.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from kvscope.engine.block_hash import short_hash
from kvscope.engine.block_pool import BlockPool
from kvscope.engine.snapshot import Snapshot


def dead_mask(block_hash: Sequence, parent_hash: Sequence, roots: Iterable) -> np.ndarray:
    """bool per block: hashed and unreachable. A block without a hash is given as None or 0."""
    index = {h: i for i, h in enumerate(block_hash) if h}
    roots = set(roots)
    reachable: dict[int, bool] = {}
    for i in index.values():
        path, j = [], i
        while True:
            if j in reachable:
                ok = reachable[j]
                break
            path.append(j)
            parent = parent_hash[j]
            if parent in roots:
                ok = True
                break
            j = index.get(parent)
            if j is None:
                ok = False
                break
        for k in path:
            reachable[k] = ok
    dead = np.zeros(len(block_hash), dtype=bool)
    dead[[i for i, ok in reachable.items() if not ok]] = True
    return dead


def dead_blocks_in_pool(pool: BlockPool) -> np.ndarray:
    return dead_mask(pool.block_hash, pool.parent_hash, pool.chain_roots)


def dead_blocks_in_snapshot(snapshot: Snapshot, roots: Iterable[bytes]) -> np.ndarray:
    """`roots`: the pool's chain_roots (full hashes); the snapshot holds short hashes."""
    return dead_mask(snapshot.block_hash.tolist(), snapshot.parent_hash.tolist(),
                     {short_hash(r) for r in roots})
