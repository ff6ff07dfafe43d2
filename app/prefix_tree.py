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
    """Roots of the prefix forest in the snapshot, biggest first. Iterative: a chain of
    thousands of blocks is fine, and nodes are made only for the runs that collapse leaves."""
    hashes = snap.block_hash.tolist()
    parents = snap.parent_hash.tolist()
    hashed = np.flatnonzero(snap.block_hash).tolist()
    by_hash = {hashes[b]: b for b in hashed}
    children: dict[int, list[int]] = {}
    root_children: dict[int, list[int]] = {}  # identity (the chain's root hash) -> blocks
    for b in hashed:
        p = by_hash.get(parents[b])
        if p is None:
            root_children.setdefault(parents[b], []).append(b)
        else:
            children.setdefault(p, []).append(b)
    placed = set(hashed)
    for table in snap.block_tables.values():  # unhashed (partial or duplicate) blocks
        table = table.tolist()
        for i, b in enumerate(table):
            if b not in placed:
                placed.add(b)
                if i:
                    children.setdefault(table[i - 1], []).append(b)
                else:
                    root_children.setdefault(0, []).append(b)
    state, ref, hits = snap.state.tolist(), snap.ref_count.tolist(), snap.hit_count.tolist()
    forest = []
    for kids in root_children.values():
        root = TreeNode([ROOT], -1, 0, 0)
        stack = [(root, kids)]
        while stack:
            parent, kids = stack.pop()
            for c in sorted(kids):
                node = TreeNode([c], state[c], ref[c], hits[c], parent=parent)
                last = c
                while collapse:  # absorb a single child that looks the same
                    nxt = children.get(last, ())
                    if (len(nxt) != 1 or state[nxt[0]] != node.state
                            or ref[nxt[0]] != node.ref_count):
                        break
                    last = nxt[0]
                    node.blocks.append(last)
                    node.hits += hits[last]
                parent.children.append(node)
                stack.append((node, children.get(last, ())))
        forest.append(root)
    forest.sort(key=lambda r: -sum(n.count for n in walk([r])))
    _layout(forest)
    return forest


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
