"""The timeline's Transfers plot: a recorded run of a real engine with a host tier (a tiny Llama,
40 device blocks, 24 host blocks) replayed in the window; the plot is chosen from View >
Timeline plots and shows the bytes offloaded and loaded (the session knows a block's) and the
copy time of each step, as the step records have them; a run whose bytes are not known shows
blocks; a run without a host tier has no such plot nor menu entry. Screenshot:
tests/artifacts/timeline-transfers.png."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from test_timeline_plots import menu_entry, readout_at, shown
from window_testutil import bare_window

from kvscope.app.panels.timeline_series import DEFAULT_PLOTS, PLOT_NAMES

SHOTS = Path("/tmp/timeline-host-shots")
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


@pytest.fixture(scope="module")
def host_run(tmp_path_factory):
    """(session path, its step records as the file has them, a block's KV bytes as the engine's
    cache tensor holds them)."""
    tests = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(tests / "models"))
    sys.path.insert(0, str(tests / "sessions"))
    from model_testutil import build_tiny_model
    from session_testutil import drive, make_engine

    from kvscope.sessions import Recorder, SessionReader

    folder = tmp_path_factory.mktemp("host_tier")
    build_tiny_model("llama3_rope_gqa_tied", folder)
    engine = make_engine(folder, host_blocks=24)
    path = folder / "host.kvscope"
    with Recorder(path, engine):
        drive(engine, max_steps=120)
    with SessionReader(path) as r:
        return path, r.steps(), engine.runner.kv_cache[:, :, 0].nbytes


def test_the_transfers_plot_from_the_view_menu_shows_each_steps_copies(qtbot, tmp_path,
                                                                       host_run):
    path, records, block_bytes = host_run
    loaded = [r.step for r in records if r.loaded_blocks]
    assert loaded and sum(r.offloaded_blocks for r in records) > 10
    w = bare_window(qtbot, tmp_path, (1280, 720))
    t = w.timeline
    entry = menu_entry(w, PLOT_NAMES["transfers"])
    assert not entry.isVisible()  # no run with a host tier yet
    assert w.open_session(str(path))
    qtbot.waitUntil(lambda: len(t.data["step"]) == len(records))
    assert entry.isVisible() and not entry.isChecked()
    assert shown(t) == list(DEFAULT_PLOTS)  # not shown until chosen
    assert "&nbsp;offloaded" not in t.legend
    entry.trigger()
    assert shown(t) == ["time", "blocks", "transfers"] and t.transfer_plot.isVisible()
    assert t.x_axis is t.transfer_plot.getAxis("bottom")
    legend = t.legend
    labels = ("offloaded", "loaded", "copy ms (right axis)")
    where = [legend.index(f"</span>&nbsp;{label}") for label in labels]  # each listed, in order
    assert where == sorted(where)
    qtbot.wait(50)
    # every step's numbers, as the session's step records have them: bytes in KiB (the unit
    # of the most moved in a step, 24 blocks of 2 KiB at most here), on the axis's title too
    assert block_bytes == 2048 and max(r.offloaded_blocks for r in records) < 512
    want = {"offloaded": [r.offloaded_blocks * block_bytes / 1024 for r in records],
            "loaded": [r.loaded_blocks * block_bytes / 1024 for r in records],
            "transfer": [r.transfer_s * 1e3 for r in records]}
    assert t.transfer_plot.getAxis("left").labelText == "host KiB"
    for name, values in want.items():
        xs, ys = t.series[name].items[0].getData()
        assert np.array_equal(xs, [r.step for r in records]), name
        assert np.allclose(ys, values, rtol=0, atol=1e-9), name
    assert t.transfer_view.isVisible() and t.transfer_view.viewRange()[1][1] >= max(
        want["transfer"])  # the right axis holds the longest copy
    # hover a step that loaded blocks back: its numbers in the readout
    s = max(loaded, key=lambda s: (records[s].loaded_blocks, records[s].offloaded_blocks))
    text = readout_at(qtbot, w, t, t.transfer_plot, s)
    r = records[s]
    assert r.loaded_blocks > 1

    def moved(n: int) -> str:
        return f"{n} block{'s' * (n != 1)}" + (f" ({2 * n} KiB)" if n else "")

    assert (f" · offloaded {moved(r.offloaded_blocks)}, loaded {moved(r.loaded_blocks)}, "
            f"{r.transfer_s * 1e3:.2g} ms") in text
    assert t.hover_lines[-1].isVisible() and t.hover_lines[-1].value() == s
    SHOTS.mkdir(exist_ok=True)
    w.grab().save(str(SHOTS / "timeline-transfers-1280x720-window.png"))
    t.grab().save(str(SHOTS / "timeline-transfers-1280x720.png"))
    t.show_plots(["time", "transfers"])  # room for the titles: "host KiB", "copy ms"
    qtbot.wait(50)
    assert t._title_fits(t.transfer_plot)
    readout_at(qtbot, w, t, t.transfer_plot, s)
    ARTIFACTS.mkdir(exist_ok=True)
    t.grab().save(str(ARTIFACTS / "timeline-transfers.png"))
    entry.trigger()  # and it leaves again
    assert "transfers" not in shown(t) and "offloaded" not in t.legend
    w.close()


def test_a_run_without_a_host_tier_has_no_transfers_plot_even_when_chosen_before(
        qtbot, tmp_path, session, host_run):
    w = bare_window(qtbot, tmp_path)
    t = w.timeline
    assert w.open_session(str(host_run[0]))
    qtbot.waitUntil(lambda: t.has_host_tier)
    menu_entry(w, PLOT_NAMES["transfers"]).trigger()
    assert "transfers" in shown(t)
    assert w.open_session(str(session))  # the demo model, no host tier
    qtbot.waitUntil(lambda: len(t.data["step"]) > 0 and not t.has_host_tier)
    assert "transfers" not in shown(t) and not menu_entry(w, PLOT_NAMES["transfers"]).isVisible()
    assert "loaded" not in t.legend and not t.transfer_view.isVisible()
    assert "loaded" not in readout_at(qtbot, w, t, t.block_plot, 3)
    w.close()


def test_records_alone_show_the_tier_at_its_first_copy(qtbot):
    """A source whose snapshots do not say there is a tier: the plot is offered at the first
    step that copied blocks, its lines padded with the steps before; nothing kept until then."""
    from kvscope.app.panels.timeline import Timeline
    from kvscope.engine.metrics import StepRecord

    t = Timeline()
    qtbot.addWidget(t)
    t.show()
    records = [StepRecord(step=i, start_s=i / 100) for i in range(10)]
    records[7].offloaded_blocks, records[7].loaded_blocks, records[7].transfer_s = 3, 1, 0.002
    t.add_records(records[:5])  # (and no block bytes set: blocks only)
    assert not t.has_host_tier and t.transfers.shape == (0, 3)
    t.add_records(records[5:])
    assert t.has_host_tier and t.plot_actions["transfers"].isVisible()
    assert np.array_equal(t.series["loaded"].items[0].getData()[1], [0] * 7 + [1, 0, 0])
    assert np.allclose(t.series["transfer"].items[0].getData()[1], [0] * 7 + [2, 0, 0])
    t.show_plots(["time", "transfers"])
    assert t._transfers_readout(7) == " · offloaded 3 blocks, loaded 1 block, 2 ms"
    assert t.transfer_plot.getAxis("left").labelText == "host blocks"
    t.set_block_bytes(24 * 1024)  # 24 KiB a block: 72 KiB offloaded, on a KiB axis
    assert t._transfers_readout(7) == " · offloaded 3 blocks (72 KiB), loaded 1 block (24 KiB), " \
        "2 ms"
    assert np.allclose(t.series["offloaded"].items[0].getData()[1], [0] * 7 + [72, 0, 0])
    assert t.transfer_plot.getAxis("left").labelText == "host KiB"
