"""The prefix-sharing tree, built from a Snapshot's chained block hashes. Qt-free.

A node per block: a cached or active full block hangs under the block whose hash is its parent
hash; a chain's first block hangs under the root of its identity (model, adapter and salt: two
tenants are two roots); a partial tail block (no hash yet) hangs under the previous block of
its request's block table. Long unbranched runs of blocks in the same state and ref count
collapse into one node that counts them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvscope.engine.snapshot import Snapshot

ROOT = -1  # pseudo block id of a root (one per identity)


@dataclass
class TreeNode:
    blocks: list[int]  # physical blocks, root first; one block unless collapsed
    state: int  # snapshot state code (roots: -1)
    ref_count: int
    hits: int  # prefix-cache hits served by these blocks (sum over a collapsed run)
    children: list[TreeNode] = field(default_factory=list)
    parent: TreeNode | None = None
    x: float = 0.0
    level: int = 0  # nodes from the root: the y of the layout

    @property
    def is_root(self) -> bool:
        return self.blocks == [ROOT]

    @property
    def count(self) -> int:
        return len(self.blocks)


def build_tree(snap: Snapshot, collapse: bool = True) -> list[TreeNode]:
    """Roots of the prefix forest in the snapshot."""
    n = snap.num_blocks
    hashed = np.flatnonzero(snap.block_hash).tolist()
    hashes = snap.block_hash.tolist()
    parents = snap.parent_hash.tolist()
    by_hash = {hashes[b]: b for b in hashed}
    parent_of = np.full(n, ROOT, dtype=np.int64)
    root_key = {}  # block -> key of the root it hangs from
    for b in hashed:
        p = by_hash.get(parents[b], ROOT)
        parent_of[b] = p
        if p == ROOT:
            root_key[b] = parents[b]
    in_tree = snap.block_hash != 0
    for table in snap.block_tables.values():  # unhashed (partial or duplicate) blocks
        for i, b in enumerate(table.tolist()):
            if not snap.block_hash[b] and not in_tree[b]:
                in_tree[b] = True
                parent_of[b] = table[i - 1] if i else ROOT
                if not i:
                    root_key[b] = 0
    nodes = {b: TreeNode([b], int(snap.state[b]), int(snap.ref_count[b]),
                         int(snap.hit_count[b])) for b in np.flatnonzero(in_tree).tolist()}
    roots: dict[int, TreeNode] = {}
    for b, node in nodes.items():
        p = int(parent_of[b])
        if p == ROOT:
            key = root_key.get(b, 0)
            parent = roots.setdefault(key, TreeNode([ROOT], -1, 0, 0))
        else:
            parent = nodes[p]
        node.parent = parent
        parent.children.append(node)
    forest = sorted(roots.values(), key=lambda r: -_size(r))
    for root in forest:
        _sort(root)
        if collapse:
            _collapse(root)
    _layout(forest)
    return forest


def _size(node: TreeNode) -> int:
    return 1 + sum(_size(c) for c in node.children)


def _sort(node: TreeNode) -> None:
    stack = [node]
    while stack:
        n = stack.pop()
        n.children.sort(key=lambda c: c.blocks[0])
        stack.extend(n.children)


def _collapse(root: TreeNode) -> None:
    """Merge a node into its single child while both look the same (state and ref count)."""
    stack = list(root.children)
    while stack:
        node = stack.pop()
        while (len(node.children) == 1 and node.children[0].state == node.state
               and node.children[0].ref_count == node.ref_count):
            child = node.children[0]
            node.blocks += child.blocks
            node.hits += child.hits
            node.children = child.children
            for c in node.children:
                c.parent = node
        stack.extend(node.children)


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
