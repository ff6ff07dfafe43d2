"""The prefix tree from chained block hashes: on the tree model and on a rendering."""

from __future__ import annotations

import random

import numpy as np
import pytest
from image_compare import ARTIFACTS, to_array
from PySide6.QtCore import QPointF

from kvscope.app.panels.prefix_tree_panel import PrefixTreePanel, node_text
from kvscope.app.panels.tree_labels import MAX_LABELS, label_text
from kvscope.app.prefix_tree import ROOT, TreeNode, _layout, build_tree, walk
from kvscope.engine import KVCacheManager
from kvscope.engine.kv_groups import ONE_GROUP, KVGroup
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


def reference_tree(snap, collapse=True, hashes=None, parents=None, tables=None):
    """The tree by a plain walk over every block, block by block: what build_tree must give.
    `hashes` and `parents` (per block, falsy: none) and `tables` (lists, -1 a null) default to
    the snapshot's."""
    if hashes is None:
        hashes, parents = snap.block_hash.tolist(), snap.parent_hash.tolist()
        tables = [t.tolist() for t in snap.block_tables.values()]
    hashed = [b for b in range(snap.num_blocks) if hashes[b]]
    by_hash = {hashes[b]: b for b in hashed}
    children, root_children = {}, {}
    for b in hashed:
        p = by_hash.get(parents[b])
        (root_children.setdefault(parents[b], []) if p is None
         else children.setdefault(p, [])).append(b)
    placed = set(hashed)
    for table in tables:
        for i, b in enumerate(table):
            if b != -1 and b not in placed:
                placed.add(b)
                (children.setdefault(table[i - 1], []) if i and table[i - 1] != -1
                 else root_children.setdefault(0, [])).append(b)
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
                while collapse:
                    nxt = children.get(last, ())
                    if (len(nxt) != 1 or state[nxt[0]] != node.state
                            or ref[nxt[0]] != node.ref_count):
                        break
                    last = nxt[0]
                    node.blocks.append(last)
                    node.hits = max(node.hits, hits[last])
                parent.children.append(node)
                stack.append((node, children.get(last, ())))
        forest.append(root)
    forest.sort(key=lambda r: -sum(n.count for n in walk([r])))
    _layout(forest)  # the same layout: the nodes and their order are what is compared
    return forest


def shape(forest):
    return [(n.blocks, n.state, n.ref_count, n.hits, n.level, n.x, len(n.children),
             n.parent.blocks if n.parent else None) for n in walk(forest)]


def random_pool(seed: int, hybrid: bool = False) -> KVCacheManager:
    """Requests over shared prefixes, follow-up turns, forks, salts, frees and evictions;
    `hybrid`: on a full-attention and a sliding-window group, with decodes (blocks leave the
    window)."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4] if hybrid else [1, 2, 4, 16])
    groups = (KVGroup(), KVGroup(rng.choice([bs, 2 * bs, 3 * bs + 1]))) if hybrid else ONE_GROUP
    mgr = KVCacheManager(rng.randrange(8, 160), bs, groups=groups)
    prompts = {}
    for rid in range(rng.randrange(1, 40)):
        live, op = list(mgr.seqs), rng.random()
        if live and op < 0.15:
            mgr.free(rng.choice(live))
            continue
        if live and op < 0.25:
            mgr.fork(rng.choice(live), 1000 + rid)
            continue
        if hybrid and live and rng.random() < 0.3:
            r, n = rng.choice(live), rng.randrange(1, 3 * bs)
            mgr.append_token_ids(r, [rng.randrange(5) for _ in range(n)])
            if mgr.can_allocate(r, n):
                mgr.allocate(r, n)
            else:
                mgr.free(r)
            continue
        if prompts and op < 0.6:
            prompt = prompts[rng.choice(list(prompts))] + [rng.randrange(5)
                                                           for _ in range(rng.randrange(1, 3 * bs))]
        else:
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 6 * bs))]
        if mgr.admit(rid, prompt, cache_salt=rng.choice([None, None, "a"])) is not None:
            prompts[rid] = prompt
        mgr.step += 1
    return mgr


@pytest.mark.parametrize("collapse", [True, False])
def test_build_tree_matches_a_plain_walk_over_every_block(collapse):
    for seed in range(60):
        snap = random_pool(seed).snapshot()
        assert shape(build_tree(snap, collapse)) == shape(reference_tree(snap, collapse)), seed


def big_pool() -> KVCacheManager:
    """16,384 blocks: 256 running requests among conversations over shared system prompts."""
    rng = random.Random(0)
    mgr = KVCacheManager(16_384, 16)
    systems = [[rng.randrange(32000) for _ in range(16 * rng.randrange(2, 12))] for _ in range(24)]
    prompts = {}
    for rid in range(1_100):
        if prompts and rng.random() < 0.65:
            prompt = prompts[rng.choice(list(prompts))] + [rng.randrange(32000)
                                                           for _ in range(rng.randrange(8, 200))]
        else:
            prompt = rng.choice(systems) + [rng.randrange(32000)
                                            for _ in range(rng.randrange(8, 900))]
        while len(mgr.seqs) >= 256:
            mgr.free(rng.choice(list(mgr.seqs)))
        while mgr.admit(rid, prompt) is None:
            mgr.free(rng.choice(list(mgr.seqs)))
        prompts[rid] = prompt
    return mgr


@pytest.fixture(scope="module")
def big_snapshot():
    return big_pool().snapshot()


def test_a_16k_block_pool_matches_the_plain_walk(big_snapshot):
    forest = build_tree(big_snapshot)
    assert len(list(walk(forest))) > 500
    assert shape(forest) == shape(reference_tree(big_snapshot))


def shown_labels(panel):
    return [label for label in panel.labels if label.isVisible()]


def test_a_thousand_nodes_stay_legible_labels_never_overlap(qtbot, big_snapshot):
    panel = PrefixTreePanel()
    qtbot.addWidget(panel)
    panel.resize(380, 420)
    panel.show()
    panel.set_snapshot(big_snapshot)
    labels = shown_labels(panel)
    assert 3 <= len(labels) <= MAX_LABELS
    rects = [label.sceneBoundingRect() for label in labels]
    for i, a in enumerate(rects):
        assert all(not a.intersects(b) for b in rects[i + 1:])
    # The longest run is labelled first; zoomed out, nodes are small dots.
    longest = max((n for n in panel.flat if not n.is_root), key=lambda n: n.count)
    assert f"×{longest.count}" in [label.toPlainText().split()[0] for label in labels]
    sizes = panel.nodes.data["size"]
    assert sizes.max() <= 9
    # Zoomed in, they get their full size back (7 px and up, bigger with more owners).
    panel.vb.setRange(xRange=(0, 6), yRange=(0, 3), padding=0)
    assert panel.nodes.data["size"].min() >= 7
    rects = [label.sceneBoundingRect() for label in shown_labels(panel)]
    for i, a in enumerate(rects):
        assert all(not a.intersects(b) for b in rects[i + 1:])


def test_the_users_zoom_survives_new_snapshots_and_double_click_fits(qtbot):
    panel = PrefixTreePanel()
    qtbot.addWidget(panel)
    panel.resize(480, 360)
    panel.show()
    mgr = two_diverging_requests()
    panel.set_snapshot(mgr.snapshot())
    fitted = panel.vb.viewRange()
    panel.vb.setRange(xRange=(0.5, 1.0), yRange=(0.5, 1.0), padding=0)
    panel.vb.sigRangeChangedManually.emit([True, True])  # what a wheel or a drag emits
    zoomed = panel.vb.viewRange()
    mgr.admit(3, SHARED_PREFIX + list(range(4000, 4100)))  # one more branch
    panel.set_snapshot(mgr.snapshot())
    assert panel.vb.viewRange() == zoomed


    class DoubleClick:
        def double(self):
            return True

    panel.plot.scene().sigMouseClicked.emit(DoubleClick())
    assert panel.auto_fit
    assert panel.vb.viewRange() != zoomed and panel.vb.viewRange() != fitted  # wider now


def test_a_rebuild_runs_in_slices_and_shows_the_tree_at_the_last(qtbot):
    panel = PrefixTreePanel()
    qtbot.addWidget(panel)
    mgr = two_diverging_requests()
    panel.set_snapshot(mgr.snapshot())
    before = panel.flat
    mgr.admit(3, SHARED_PREFIX + list(range(4000, 4100)))
    panel.prepare(mgr.snapshot())
    slices = 1
    while panel.pending:
        assert panel.flat is before  # the old tree stays on screen until the last slice
        panel.advance()
        slices += 1
    assert slices == 3 and len(panel.flat) == len(before) + 1


def test_a_selected_request_outlines_the_nodes_holding_its_blocks(qtbot):
    panel = PrefixTreePanel()
    qtbot.addWidget(panel)
    mgr = two_diverging_requests()
    snap = mgr.snapshot()
    panel.set_snapshot(snap)
    panel.highlight(snap.block_tables[1])
    held = [n for n in panel.flat if set(n.blocks) & set(snap.block_tables[1].tolist())]
    assert len(held) == 2  # the shared run and its own branch
    assert sorted(panel.outline.data["x"]) == sorted(n.x for n in held)
    panel.highlight(None)
    assert len(panel.outline.data) == 0


def test_the_windows_tree_is_rebuilt_a_slice_a_frame_and_catches_up_after_the_last(qtbot,
                                                                                   tmp_path):
    from PySide6.QtCore import QSettings

    from kvscope.app.frames import Frame
    from kvscope.app.window.main_window import MainWindow

    window = MainWindow(settings=QSettings(str(tmp_path / "k.ini"), QSettings.IniFormat))
    qtbot.addWidget(window)
    window.frame_timer.stop()  # frames and timer ticks by hand
    window.resize(1400, 900)
    window.show()
    mgr = two_diverging_requests()
    window.show_frame(Frame(snapshot=mgr.snapshot()))  # starts a rebuild: its first slice
    assert window.tree.pending and not window.tree.flat
    mgr.admit(3, SHARED_PREFIX + list(range(4000, 4100)))
    window.show_frame(Frame(snapshot=mgr.snapshot()))  # the second slice
    window.show_frame(Frame(snapshot=mgr.snapshot()))  # the last: the first snapshot's tree
    assert not window.tree.pending and window.tree.snapshot is not window.snapshot
    window.frame_pump.tree_due = 0.0  # 1 / TREE_HZ later, no frame comes: the tree catches up
    for _ in range(3):
        window.frame_pump.update_tree()
    assert window.tree.snapshot is window.snapshot
    assert len(window.tree.flat) == len(list(walk(build_tree(window.snapshot))))
    window.frame_pump.update_tree()
    assert not window.tree.pending  # nothing new: nothing rebuilt


def test_a_collapsed_run_counts_the_requests_that_hit_it_not_hits_times_blocks():
    mgr = two_diverging_requests()  # request 2 hits request 1's 5 prefix blocks
    mgr.free(1)
    mgr.free(2)
    mgr.admit(3, SHARED_PREFIX + [7])  # and request 3
    snap = mgr.snapshot()
    (root,) = build_tree(snap, collapse=True)
    (run,) = [n for n in walk(root.children) if n.count == 5]
    assert run.hits == 2  # two requests, not 2 x 5 block hits
    assert label_text(run) == "×5 · hit by 2 requests"  # the label says requests too
    assert "hit by 2 requests" in node_text(run, snap)


def test_hovering_a_node_explains_it_in_words_not_raw_coordinates(qtbot):
    panel = PrefixTreePanel()
    qtbot.addWidget(panel)
    panel.resize(480, 360)
    panel.show()
    qtbot.waitExposed(panel)
    snap = two_diverging_requests().snapshot()
    panel.set_snapshot(snap)
    qtbot.wait(50)
    (shared,) = [n for n in panel.flat if n.state == SHARED]
    x, y = panel.nodes.getData()
    i = panel.flat.index(shared)
    scene = panel.vb.mapViewToScene(QPointF(float(x[i]), float(y[i])))
    qtbot.mouseMove(panel.plot.viewport(), panel.plot.mapFromScene(scene))
    qtbot.waitUntil(lambda: panel.plot.toolTip() == node_text(shared, snap))
    assert panel.plot.toolTip().startswith("5 blocks") and "x:" not in panel.plot.toolTip()
    assert panel.info.text() == panel.plot.toolTip()


@pytest.mark.parametrize("height", [120, 150, 400])
def test_a_short_tree_view_still_labels_its_root_and_its_deepest_run(qtbot, height):
    """Fitted into a short dock (the 1280x720 layout), 8 % of the range was fewer pixels than
    half a label: the root's label (its identity) and the leaf's were cut and not drawn."""
    panel = PrefixTreePanel()
    qtbot.addWidget(panel)
    panel.resize(380, height)
    panel.show()
    qtbot.waitExposed(panel)
    mgr = KVCacheManager(64, BS)
    mgr.admit(1, SHARED_PREFIX)  # one chain: a root and one run of 5 blocks below it
    panel.set_snapshot(mgr.snapshot())
    panel.fit()
    panel.set_snapshot(mgr.snapshot())
    texts = [label.toPlainText() for label in shown_labels(panel)]
    assert any(t.startswith("×5") for t in texts), texts
    assert len(texts) == 2, texts  # and the root's
    ys = sorted(label.pos().y() for label in shown_labels(panel))
    assert ys[0] != ys[1]  # one per row: the root above, the run below
