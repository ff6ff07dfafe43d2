"""The timeline's KV-groups plot: a recorded hybrid run (a tiny Qwen2 with a sliding-window
layer: two KV-cache groups) replayed in the window; the plot is chosen from View > Timeline
plots and shows the same per-group numbers the engine published; a one-group run has no such
plot nor menu entry."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from test_timeline_plots import SIZES, menu_entry, readout_at, shown
from window_testutil import bare_window

from kvscope.app.panels.timeline_series import DEFAULT_PLOTS, PLOT_NAMES

SHOTS = Path("/tmp/win-tree-shots")


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory):
    """(session path, the engine's own step records): long prompts that share a prefix, so the
    window (6 tokens, blocks of 4) releases blocks in most steps."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from model_testutil import build_tiny_model

    from kvscope.engine import Engine, EngineConfig, SamplingParams
    from kvscope.engine.models.load import load_model
    from kvscope.sessions import Recorder

    folder = tmp_path_factory.mktemp("hybrid_window")
    build_tiny_model("qwen2_window_layers", folder)
    engine = Engine(load_model(folder), EngineConfig(block_size=4, num_blocks=96,
                                                     max_num_batched_tokens=32, max_num_seqs=4))
    path = folder / "hybrid.kvscope"
    system = [5 + i % 200 for i in range(40)]
    with Recorder(path, engine):
        for i in range(6):
            engine.add_request(system + [7 + i] * (8 + 5 * i),
                               SamplingParams(max_tokens=12 + 2 * i, ignore_eos=True))
            engine.step()
        while engine.has_unfinished():
            engine.step()
    return path, list(engine.step_records)


@pytest.mark.parametrize("size", SIZES, ids=["1280x720", "1600x1000"])
def test_the_kv_groups_plot_from_the_view_menu_replays_each_groups_blocks(qtbot, tmp_path,
                                                                          hybrid_run, size):
    path, records = hybrid_run
    assert sum(r.window_freed_blocks for r in records) > 10
    w = bare_window(qtbot, tmp_path, size)
    t = w.timeline
    entry = menu_entry(w, PLOT_NAMES["groups"])
    assert not entry.isVisible()  # no run with groups yet
    assert w.open_session(str(path))
    qtbot.waitUntil(lambda: len(t.data["step"]) == len(records))
    assert entry.isVisible() and not entry.isChecked()
    assert shown(t) == list(DEFAULT_PLOTS)  # not shown until chosen
    entry.trigger()
    assert shown(t) == ["time", "blocks", "groups"] and t.group_plot.isVisible()
    assert t.x_axis is t.group_plot.getAxis("bottom")
    legend = t.legend
    labels = ("full attention held", "sliding window 6 held", "freed by the window")
    assert [legend.index(label) for label in labels] == sorted(legend.index(x) for x in labels)
    qtbot.wait(50)
    # every step's numbers, as the engine published them while it ran
    want = np.array([r.group_blocks for r in records], dtype=float)
    freed = np.array([r.window_freed_blocks for r in records], dtype=float)
    for g in (0, 1):
        xs, ys = t.series[f"group{g}"].items[0].getData()
        assert np.array_equal(ys, want[:, g]) and np.array_equal(xs, t.data["step"])
    assert np.array_equal(t.series["freed"].items[0].getData()[1], freed)
    # hover a step where the window let go of blocks: its numbers in the readout
    s = int(np.flatnonzero(freed)[len(np.flatnonzero(freed)) // 2])
    text = readout_at(qtbot, w, t, t.group_plot, s)
    r = records[s]
    assert (f"held full: {r.group_blocks[0]}, window 6: {r.group_blocks[1]} · window freed "
            f"{r.window_freed_blocks}") in text
    SHOTS.mkdir(exist_ok=True)
    w.grab().save(str(SHOTS / f"timeline-groups-{size[0]}x{size[1]}-window.png"))
    t.grab().save(str(SHOTS / f"timeline-groups-{size[0]}x{size[1]}.png"))
    entry.trigger()  # and it leaves again
    assert "groups" not in shown(t) and "freed by the window" not in t.legend
    w.close()


def test_a_one_group_run_has_no_groups_plot_even_when_chosen_before(qtbot, tmp_path, session,
                                                                    hybrid_run):
    w = bare_window(qtbot, tmp_path)
    t = w.timeline
    assert w.open_session(str(hybrid_run[0]))
    qtbot.waitUntil(lambda: t.num_groups == 2)
    menu_entry(w, PLOT_NAMES["groups"]).trigger()
    assert "groups" in shown(t)
    assert w.open_session(str(session))  # the demo model: one group
    qtbot.waitUntil(lambda: len(t.data["step"]) > 0 and t.num_groups == 1)
    assert "groups" not in shown(t) and not menu_entry(w, PLOT_NAMES["groups"]).isVisible()
    assert "held" not in t.legend and len(t.hover_lines) == len(t.cursors) == 5
    assert "held" not in readout_at(qtbot, w, t, t.block_plot, 3)
    w.close()
