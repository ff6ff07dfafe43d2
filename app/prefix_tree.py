"""The prefix-sharing tree, built from a Snapshot's chained block hashes. Qt-free.

A node per block: a cached or active full block hangs under the block whose hash is its parent
hash; a chain's first block hangs under the root of its identity (model, adapter and salt: two
tenants are two roots); a partial tail block (no hash yet) hangs under the previous block of
its request's block table. Long unbranched runs of blocks in the same state and ref count
collapse into one node that counts them.

A model with several KV-cache groups (kv_groups) has one tree per group, built by itself: each
group keeps its own tables, and a group g >= 1 stores a hash under `group_key(h, g)`, whose
short hash is group 0's, so a tree of every block would hang one group's chain on the other's.
`group` picks the blocks that group allocated (Snapshot.block_group) and its tables. A sliding
window group's tables hold nulls where blocks left the window: its tree shows the chains'
blocks still cached or held; a block whose chain parent was evicted starts a chain under a root
of its own (keyed by the gone parent's hash), as any chain whose parent is gone; a block after
a null hangs under the root."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvscope.engine.kv_groups import NULL
from kvscope.engine.snapshot import Snapshot

ROOT = -1  # pseudo block id of a root (one per identity)


@dataclass
class TreeNode:
    blocks: list[int]  # physical blocks, root first; one block unless collapsed
    state: int  # snapshot state code (roots: -1)
    ref_count: int
    hits: int  # requests that hit these blocks in the prefix cache (a hit on a run of blocks
    #            hits its first: the most of any of its blocks)
    children: list[TreeNode] = field(default_factory=list)
    parent: TreeNode | None = None
    x: float = 0.0
    level: int = 0  # nodes from the root: the y of the layout
    key: int = 0  # a root's identity: the short parent hash of its chains' first blocks (the
    #               digest of model, adapter and salt); 0: first blocks without a hash yet

    @property
    def is_root(self) -> bool:
        return self.blocks == [ROOT]

    @property
    def count(self) -> int:
        return len(self.blocks)


def build_tree(snap: Snapshot, collapse: bool = True, group: int = 0) -> list[TreeNode]:
    """Roots of the prefix forest of KV-cache `group` in the snapshot, biggest first.

    Array work over all blocks, Python work per node only: a pool of 16,384 blocks builds in a
    few milliseconds, and a chain of thousands of blocks is fine."""
    return make_forest(snap, find_runs(snap, collapse, group))


def group_tables(snap: Snapshot, group: int) -> dict[int, np.ndarray]:
    """The requests' block tables in KV-cache `group` (NULL where a window released a block;
    none where the source has no tables, e.g. an attached server's hash slots)."""
    if group == 0:
        return snap.block_tables
    return snap.more_tables[group - 1] if group <= len(snap.more_tables) else {}


@dataclass
class Runs:
    """The blocks of a snapshot's tree grouped into nodes (runs of blocks), as arrays."""

    members: np.ndarray  # every block in the tree, node by node, each node root side first
    heads: np.ndarray  # each node's first block, ascending
    starts: np.ndarray  # where each node's blocks start in members
    parent: np.ndarray  # per block: the block it hangs under; -1 a root, -2 not in the tree
    head: np.ndarray  # per block: its node's first block


def find_runs(snap: Snapshot, collapse: bool = True, group: int = 0) -> Runs:
    """The first half of build_tree (numpy only): which blocks make up each node."""
    n = snap.num_blocks
    parent = _parent_blocks(snap, group)
    state, ref = snap.state, snap.ref_count
    num_children = np.bincount(parent[parent >= 0], minlength=n)
    up = np.maximum(parent, 0)
    # A block joins its parent's node when it is the parent's only child and looks the same.
    merge = (parent >= 0) & (num_children[up] == 1) & (state == state[up]) & (ref == ref[up])
    if not collapse:
        merge[:] = False
    head, depth = _run_heads(np.where(merge, parent, np.arange(n)), merge)
    members = np.flatnonzero(parent > -2)
    key = head[members] * (int(depth.max(initial=0)) + 1) + depth[members]  # unique per block
    members = members[np.argsort(key)]  # by node, root side first
    heads, starts = np.unique(head[members], return_index=True)
    return Runs(members, heads, starts, parent, head)


def make_forest(snap: Snapshot, runs: Runs) -> list[TreeNode]:
    """The second half of build_tree: the nodes, linked and laid out."""
    heads, parent = runs.heads, runs.parent
    hits = np.maximum.reduceat(snap.hit_count[runs.members], runs.starts) if len(heads) else heads
    bounds = np.append(runs.starts, len(runs.members)).tolist()
    members = runs.members.tolist()
    nodes = [TreeNode(members[a:b], s, r, int(h)) for a, b, s, r, h in zip(
        bounds[:-1], bounds[1:], snap.state[heads].tolist(), snap.ref_count[heads].tolist(),
        hits.tolist(), strict=True)]
    node_of = dict(zip(heads.tolist(), nodes, strict=True))
    up_heads = runs.head[np.maximum(parent[heads], 0)].tolist()
    roots: dict[int, TreeNode] = {}  # identity (the parent hash of a chain's first block)
    for node, p, up_head, key in zip(nodes, parent[heads].tolist(), up_heads,
                                     snap.parent_hash[heads].tolist(), strict=True):
        if p >= 0:  # nodes come in block order: each parent's children in block order
            node.parent = node_of[up_head]
        else:  # under the root of its identity (0: a first block without a hash)
            if key not in roots:
                roots[key] = TreeNode([ROOT], -1, 0, 0, key=key)
            node.parent = roots[key]
        node.parent.children.append(node)
    forest = [roots[k] for k in sorted(roots, key=lambda k: k == 0)]  # unhashed firsts last
    forest.sort(key=lambda r: -sum(c.count for c in walk(r.children)))
    _layout(forest)
    return forest


def _parent_blocks(snap: Snapshot, group: int = 0) -> np.ndarray:
    """The block each block of `group` hangs under: its parent hash's block in the group, or,
    for an unhashed (partial or duplicate) block, the previous block of the first table holding
    it; -1 under a root; -2 for blocks not in the group's tree."""
    n = snap.num_blocks
    parent = np.full(n, -2, dtype=np.int64)
    hashed = snap.block_hash != 0
    if len(snap.groups) > 1:  # (one group: every block is group 0's, whatever a file says)
        hashed &= snap.block_group == group
    hashed = np.flatnonzero(hashed)
    if len(hashed):
        order = np.argsort(snap.block_hash[hashed], kind="stable")
        sorted_hashes = snap.block_hash[hashed][order]
        wanted = snap.parent_hash[hashed]
        at = np.searchsorted(sorted_hashes, wanted, side="right") - 1  # the last of equals
        found = (at >= 0) & (sorted_hashes[np.maximum(at, 0)] == wanted)
        parent[hashed] = np.where(found, hashed[order[np.maximum(at, 0)]], -1)
    tables = [t for t in group_tables(snap, group).values() if len(t)]
    if tables:
        blocks = np.concatenate(tables).astype(np.int64)
        previous = np.empty_like(blocks)
        previous[1:] = blocks[:-1]  # (after a null: NULL, -1, under the root)
        previous[np.cumsum([0] + [len(t) for t in tables[:-1]])] = -1  # a table's first block
        loose = (blocks != NULL) & (snap.block_hash[blocks] == 0)
        first, at = np.unique(blocks[loose], return_index=True)  # a block's first table wins
        parent[first] = previous[loose][at]
    return parent


def _run_heads(up: np.ndarray, merge: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each block, the first block of its collapsed run and its distance from it, by
    pointer doubling over `up` (the parent where a block merges, itself where it does not)."""
    head, depth = up.copy(), merge.astype(np.int64)
    for _ in range(64):
        nxt = head[head]
        if np.array_equal(nxt, head):
            break
        depth += depth[head]
        head = nxt
    return head, depth


def _layout(forest: list[TreeNode]) -> None:
    """Leaves on consecutive x slots, parents centred over their children, y = level."""
    next_x = 0.0
    for root in forest:
        order, stack = [], [(root, 0)]
        while stack:
            node, level = stack.pop()
            node.level = level
            order.append(node)
            stack.extend((c, level + 1) for c in reversed(node.children))
        for node in reversed(order):  # children before parents
            if node.children:
                node.x = (node.children[0].x + node.children[-1].x) / 2
            else:
                node.x = next_x
                next_x += 1
        next_x += 1  # a gap between identities


def walk(forest: list[TreeNode]):
    stack = list(reversed(forest))
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(node.children))
