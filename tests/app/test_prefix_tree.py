"""The prefix tree from chained block hashes: on the tree model and on a rendering."""

from __future__ import annotations

import numpy as np
from image_compare import ARTIFACTS, to_array

from kvscope.app.panels.prefix_tree_panel import PrefixTreePanel
from kvscope.app.prefix_tree import build_tree, walk
from kvscope.engine import KVCacheManager
from kvscope.engine.snapshot import ACTIVE, CACHED, SHARED

BS = 16
SHARED_PREFIX = list(range(1000, 1000 + 5 * BS))


def two_diverging_requests():
    mgr = KVCacheManager(64, BS)
    mgr.admit(1, SHARED_PREFIX + list(range(2000, 2040)))  # 5 shared + 2 full + 1 partial
    mgr.admit(2, SHARED_PREFIX + list(range(3000, 3020)))  # 5 shared + 1 full + 1 partial
    return mgr


def test_two_requests_sharing_five_blocks_make_one_chain_and_two_branches():
    snap = two_diverging_requests().snapshot()
    (root,) = build_tree(snap, collapse=False)
    chain, node = [], root
    while len(node.children) == 1:
        node = node.children[0]
        chain.append(node)
    assert [n.state for n in chain] == [SHARED] * 5
    assert [n.ref_count for n in chain] == [2] * 5
    assert chain[-1].blocks == [snap.block_tables[1][4]]
    assert len(chain[-1].children) == 2
    branches = sorted(chain[-1].children, key=lambda n: n.blocks[0])
    lengths = []
    for b in branches:
        n, k = b, 1
        while n.children:
            (n,) = n.children
            k += 1
        lengths.append(k)
    assert sorted(lengths) == [2, 3]  # the partial tail blocks hang under their table's block
    assert all(n.state == ACTIVE for n in walk(branches))
    # Collapsed: the 5 shared blocks are one node counting them, then the two branches.
    (root,) = build_tree(snap)
    (shared,) = root.children
    assert shared.count == 5 and shared.state == SHARED and len(shared.children) == 2
    assert sorted(c.count for c in shared.children) == [2, 3]


def test_cached_blocks_keep_their_place_and_hits_are_counted():
    mgr = two_diverging_requests()
    mgr.free(1)
    mgr.free(2)
    mgr.admit(3, SHARED_PREFIX + [7])  # hits the 5 cached prefix blocks
    snap = mgr.snapshot()
    (root,) = build_tree(snap, collapse=False)
    first = root.children[0]
    assert first.state == ACTIVE and first.hits == 2  # request 2, then request 3
    states = {n.state for n in walk(root.children)}
    assert CACHED in states  # the branches survive as cached blocks under the prefix


def test_salts_are_separate_roots():
    mgr = KVCacheManager(64, BS)
    mgr.admit(1, SHARED_PREFIX + [1], cache_salt="a")
    mgr.admit(2, SHARED_PREFIX + [1], cache_salt="b")
    assert len(build_tree(mgr.snapshot())) == 2


def test_tree_rendering_shows_shared_nodes_and_two_branches(qtbot):
    panel = PrefixTreePanel()
    qtbot.addWidget(panel)
    panel.resize(480, 360)
    panel.show()
    snap = two_diverging_requests().snapshot()
    panel.set_snapshot(snap)
    qtbot.wait(50)
    image = panel.grab().toImage()
    ARTIFACTS.mkdir(exist_ok=True)
    image.save(str(ARTIFACTS / "prefix_tree.png"))
    rgb = to_array(image)
    orange = np.all(np.abs(rgb.astype(int) - [0xE6, 0x9F, 0x00]) < 40, axis=2)
    blue = np.all(np.abs(rgb.astype(int) - [0x00, 0x72, 0xB2]) < 40, axis=2)
    assert orange.sum() > 50 and blue.sum() > 60  # one 13-px node, two 10-px nodes
    # The shared node sits above the two branches, which sit side by side.
    ys, xs = np.nonzero(blue)
    assert np.nonzero(orange)[0].mean() < ys.mean()
    left, right = xs < xs.mean(), xs >= xs.mean()
    assert left.sum() > 20 and right.sum() > 20


def test_a_thousand_nodes_build_quickly_enough_to_draw(qtbot):
    mgr = KVCacheManager(1400, 4)
    rng = np.random.default_rng(0)
    for rid in range(130):
        base = [int(x) for x in rng.integers(0, 6, size=3)]  # many shared short prefixes
        mgr.admit(rid, [t for b in base for t in [b] * 4] + list(range(rid * 100, rid * 100 + 28)))
    snap = mgr.snapshot()
    flat = list(walk(build_tree(snap, collapse=False)))
    assert len(flat) > 1000
    panel = PrefixTreePanel()
    qtbot.addWidget(panel)
    panel.set_snapshot(snap)
    assert len(panel.flat) == len(list(walk(build_tree(snap))))
