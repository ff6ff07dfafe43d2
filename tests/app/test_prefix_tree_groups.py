"""The prefix tree of a model with several KV-cache groups: one tree per group (a group g >= 1
keys its hashes as group_key(h, g), whose short hash is group 0's), a selector in the panel, and
selection across the panels."""

from __future__ import annotations

import numpy as np
import pytest
from PySide6.QtCore import QPointF, Qt
from test_prefix_tree import random_pool, reference_tree, shape
from window_testutil import bare_window

from kvscope.app.frames import Frame
from kvscope.app.panels.prefix_tree_panel import PrefixTreePanel, node_text
from kvscope.app.prefix_tree import build_tree, walk
from kvscope.app.tree_identities import Identities
from kvscope.engine import KVCacheManager
from kvscope.engine.kv_groups import NULL, KVGroup
from kvscope.engine.snapshot import ACTIVE, CACHED

BS, W = 4, 8
A = list(range(100, 132))  # 32 tokens: 8 full blocks


def hybrid_pool(num_blocks: int = 40) -> tuple[KVCacheManager, list[int]]:
    """A (34 tokens) admitted, then a decode token: its window group released blocks 0-5 (kept
    cached); returns the manager and the window group's table as it was before the release."""
    mgr = KVCacheManager(num_blocks, BS, groups=(KVGroup(), KVGroup(W)))
    mgr.admit(0, A + [1, 2])
    window = mgr.block_table(0, 1)[:]
    mgr.append_token_ids(0, [7])
    mgr.allocate(0, 1)
    return mgr, window


def blocks_of(forest) -> list[int]:
    return sorted(b for n in walk(forest) if not n.is_root for b in n.blocks)


def test_each_group_has_its_own_chain_not_one_tree_of_both():
    mgr, window = hybrid_pool()
    snap = mgr.snapshot()
    full = mgr.block_table(0, 0)
    assert mgr.block_table(0, 1)[:6] == [NULL] * 6  # (35 - 8 + 1) // 4 blocks left the window
    (root,) = build_tree(snap, group=0)
    (chain,) = root.children  # one run of 9 active blocks: no window block among them
    assert chain.blocks == full and chain.state == ACTIVE and not chain.children
    (root,) = build_tree(snap, group=1)
    (released,) = root.children  # the released head, cached, then the held tail
    assert released.blocks == window[:6] and released.state == CACHED
    (held,) = released.children
    assert held.blocks == window[6:] + mgr.block_table(0, 1)[9:] and held.state == ACTIVE
    assert node_text(held, snap, group=1).endswith("owners #0")  # in the group's own tables
    assert "owners" not in node_text(held, snap, group=0)
    assert blocks_of(build_tree(snap, group=1)) == sorted(window + mgr.block_table(0, 1)[9:])


def test_a_chain_whose_head_was_evicted_starts_under_a_root_of_its_own():
    """Pool 20: D's 3 blocks per group take the 2 free blocks and evict window blocks 5, 4,
    3, 2 (released tail first: first in the LRU order). The window group then has A's blocks
    0-1 (cached, under the identity) and 6-8 whose parent (5) is gone: a chain of their own."""
    mgr, window = hybrid_pool(20)
    assert mgr.admit(2, list(range(500, 512))) == 0
    snap = mgr.snapshot()
    forest = build_tree(snap, collapse=False, group=1)
    identity = int(snap.parent_hash[window[0]])
    first = {n.blocks[0]: n for n in walk(forest)}
    assert first[window[0]].parent.key == identity
    gone = first[window[6]].parent
    assert gone.is_root and gone.key == int(snap.parent_hash[window[6]]) != identity
    (second,) = first[window[0]].children
    assert second.blocks == [window[1]] and not second.children  # 2-5 evicted (now D's)
    assert [first[window[i]].parent.blocks for i in (7, 8)] == [[window[6]], [window[7]]]
    assert "salt unknown" in Identities().words(gone)  # said as any chain whose parent is gone
    # full attention lost nothing: A's 9 blocks are one chain under the identity
    full = mgr.block_table(0, 0)
    node = {n.blocks[0]: n for n in walk(build_tree(snap, collapse=False, group=0))}
    assert node[full[0]].parent.key == identity
    assert all(node[b].parent is node[a] for a, b in zip(full, full[1:], strict=False))


@pytest.mark.parametrize("collapse", [True, False])
def test_each_groups_tree_matches_a_plain_walk_over_that_groups_full_keys(collapse):
    """The reference reads the pool's full hash keys (a group g >= 1 key ends in the byte g)
    and the manager's tables, not the snapshot's short hashes and block_group."""
    released = 0
    for seed in range(60):
        mgr = random_pool(seed, hybrid=True)
        snap = mgr.snapshot()
        pool = mgr.pool
        for g in (0, 1):
            def mine(key, g=g):  # a sha256 digest (32 bytes), then the group's byte if g > 0
                return key is not None and len(key) == 32 + (g > 0) and (g == 0 or key[-1] == g)
            hashes = [k if mine(k) else None for k in pool.block_hash]
            parents = [p if mine(k) else None for k, p in zip(pool.block_hash, pool.parent_hash,
                                                              strict=True)]
            tables = [mgr.block_table(r, g) for r in mgr.seqs]
            released += sum(t.count(NULL) for t in tables)
            want = reference_tree(snap, collapse, hashes, parents, tables)
            assert shape(build_tree(snap, collapse, g)) == shape(want), (seed, g)
    assert released > 50  # the window group's tables had nulls to skip


def show(panel_or_window, snap) -> None:
    panel_or_window.show_frame(Frame(snapshot=snap))
    tree = getattr(panel_or_window, "tree", panel_or_window)
    tree.flush()


def test_the_selector_shows_only_with_several_groups_and_keys_pick_the_group(qtbot):
    panel = PrefixTreePanel()
    qtbot.addWidget(panel)
    panel.resize(500, 400)
    panel.show()
    one = KVCacheManager(40, BS)
    one.admit(0, A)
    show(panel, one.snapshot())
    assert panel.group_row.isHidden() and panel.group == 0
    mgr, window = hybrid_pool()
    snap = mgr.snapshot()
    show(panel, snap)
    assert panel.group_row.isVisible()
    assert [panel.group_box.itemText(i) for i in range(2)] == ["full attention",
                                                               "sliding window 8"]
    assert blocks_of(panel.forest) == mgr.block_table(0, 0)  # full attention by default
    panel.group_box.setFocus()
    qtbot.keyClick(panel.group_box, Qt.Key_Down)
    assert panel.group == 1
    assert blocks_of(panel.forest) == sorted(window + mgr.block_table(0, 1)[9:])
    assert len(panel.flat) == 3  # the root, the released head (cached), the held tail
    qtbot.keyClick(panel.group_box, Qt.Key_Up)
    assert blocks_of(panel.forest) == mgr.block_table(0, 0)
    show(panel, one.snapshot())  # a one-group source again: no selector, group 0
    assert panel.group_row.isHidden() and panel.group == 0


def click_node(qtbot, tree, node) -> None:
    scene = tree.vb.mapViewToScene(QPointF(node.x, node.level))
    qtbot.mouseClick(tree.plot.viewport(), Qt.LeftButton, pos=tree.plot.mapFromScene(scene))


def test_a_window_groups_node_clicked_is_outlined_in_the_pool(qtbot, tmp_path):
    w = bare_window(qtbot, tmp_path, (1400, 900))
    w.frame_timer.stop()
    mgr, window = hybrid_pool()
    show(w, mgr.snapshot())
    tree, pool = w.tree, w.pool
    tree.show_group(1)
    qtbot.wait(20)
    held = next(n for n in tree.flat if not n.is_root and n.state == ACTIVE)
    click_node(qtbot, tree, held)
    assert w.selection.blocks == (held.blocks[0],)
    assert w.selection.request == 0  # its owner, found in the window group's table
    assert pool.highlighted.tolist() == [held.blocks[0]] == [window[6]]
    # a selected request: its blocks of the group shown are outlined in the tree
    w.selection.select_request(None)
    w.selection.select_request(0)
    xs = sorted(tree.outline.data["x"])
    assert xs == sorted(n.x for n in tree.flat if not n.is_root and n.state == ACTIVE)
    tree.show_group(0)
    assert sorted(tree.outline.data["x"]) == [n.x for n in tree.flat if not n.is_root]
    w.close()


@pytest.mark.parametrize("size", [(1280, 720), (1600, 1000)], ids=["1280x720", "1600x1000"])
def test_screenshot_of_a_window_groups_tree(qtbot, tmp_path, size):
    from pathlib import Path

    out = Path("/tmp/win-tree-shots")
    out.mkdir(exist_ok=True)
    w = bare_window(qtbot, tmp_path, size)
    w.frame_timer.stop()
    mgr = KVCacheManager(96, BS, groups=(KVGroup(), KVGroup(W)))
    system = list(range(1000, 1024))
    for rid in range(4):  # a shared system prompt, then each its own question and answer
        mgr.admit(rid, system + [rid] * (6 + 4 * rid))
        for _ in range(6 + 3 * rid):
            mgr.append_token_ids(rid, [rid + 50])
            mgr.allocate(rid, 1)
    mgr.free(1)
    show(w, mgr.snapshot())
    w.tree.show_group(1)
    w.selection.select_request(2)
    qtbot.wait(50)
    assert w.tree.group_row.isVisible()
    name = f"tree-window-group-{size[0]}x{size[1]}"
    w.grab().save(str(out / f"{name}-window.png"))
    w.tree.grab().save(str(out / f"{name}.png"))
    assert np.any([n.state == CACHED for n in w.tree.flat])
    w.close()


def test_a_source_without_tables_still_has_a_tree_per_group():
    """As an attached server's hash slots: groups and each slot's group, no block tables."""
    mgr, window = hybrid_pool()
    full = mgr.block_table(0, 0)[:]
    mgr.free(0)
    snap = mgr.snapshot()
    snap.block_tables, snap.more_tables = {}, ()
    # the full blocks stay cached in each group; each partial last block is free
    assert blocks_of(build_tree(snap, group=0)) == full[:8]
    assert blocks_of(build_tree(snap, group=1)) == window[:8]
