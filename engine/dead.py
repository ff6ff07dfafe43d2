"""Dead cache: resident blocks that can never hit again because a block before them in their
chain is gone. A lookup walks a prompt's chain from the first block and stops at the first miss,
so everything below a missing ancestor is unreachable, yet holds pool space until evicted.

Works on a live pool and on a Snapshot alike: a block is reachable when its parent is a chain
root (`BlockPool.chain_roots`: the parent hashes of first blocks) or a reachable resident block.

KV-cache groups (kv_groups): the walk above is full attention's, within its own group. A sliding
window group's block is not reached through its parent (a window needs only its last blocks
before the hit point: vLLM's hybrid coordinator) but through full attention, since every group
must accept a hit: it is dead when full attention holds no reachable block of the same tokens.
With windows only, no block is dead (its chain's earlier blocks are never needed).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from kvscope.engine.block_hash import short_hash
from kvscope.engine.block_pool import BlockPool
from kvscope.engine.kv_groups import ONE_GROUP, KVGroup
from kvscope.engine.snapshot import Snapshot


def dead_mask(block_hash: Sequence, parent_hash: Sequence, roots: Iterable,
              block_group: Sequence[int] | None = None, groups: Sequence[KVGroup] = ONE_GROUP,
              same_tokens=lambda h: h) -> np.ndarray:
    """bool per block: hashed and unreachable. A block without a hash is given as None or 0.
    With several groups, `block_group` is each block's and `same_tokens(h)` the key of a window
    block's tokens in full attention (the group byte stripped from a full key; a short hash is
    the same in every group)."""
    if len(groups) == 1 and groups[0].window is None:
        return _walk(block_hash, parent_hash, roots)
    dead = np.zeros(len(block_hash), dtype=bool)
    if groups[0].window is not None:
        return dead
    full = [h if g == 0 else None for h, g in zip(block_hash, block_group, strict=True)]
    dead = _walk(full, parent_hash, roots)
    alive = {h for h, d in zip(full, dead, strict=True) if h and not d}
    for i, (h, g) in enumerate(zip(block_hash, block_group, strict=True)):
        if h and g != 0:
            dead[i] = same_tokens(h) not in alive
    return dead


def _walk(block_hash: Sequence, parent_hash: Sequence, roots: Iterable) -> np.ndarray:
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


def dead_blocks_in_pool(pool: BlockPool, groups: Sequence[KVGroup] = ONE_GROUP) -> np.ndarray:
    """`groups`: the manager's (a pool does not know which of its groups are windows)."""
    return dead_mask(pool.block_hash, pool.parent_hash, pool.chain_roots, pool.group, groups,
                     lambda key: key[:-1])  # (kv_groups.group_key appends the group's byte)


def dead_blocks_in_snapshot(snapshot: Snapshot, roots: Iterable[bytes]) -> np.ndarray:
    """`roots`: the pool's chain_roots (full hashes); the snapshot holds short hashes."""
    return dead_mask(snapshot.block_hash.tolist(), snapshot.parent_hash.tolist(),
                     {short_hash(r) for r in roots}, snapshot.block_group.tolist(),
                     snapshot.groups)
