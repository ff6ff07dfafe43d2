"""The timeline at 10,000 steps: what the curves are given, when they are redrawn, the grid; its
public series API (a line of another owner added, given data, shown, hidden, relabelled without
reaching into the plots; every line drawn in the legend)."""

from __future__ import annotations

import numpy as np
import pytest
from PySide6.QtCore import QPointF, Qt

from kvscope.app.frames import Frame
from kvscope.app.panels.timeline import MAX_WAIT_S, Timeline, _bars, _peaks
from kvscope.engine.metrics import StepRecord


def records(n: int, start: int = 0) -> list[StepRecord]:
    return [StepRecord(step=s, start_s=s * 0.01, prefill_s=0.002 * (s % 7 == 0), decode_s=0.008,
                       prefill_tokens=512 * (s % 7 == 0), decode_tokens=64, batch_size=64,
                       num_active_blocks=9000 + s % 100, num_cached_blocks=3000,
                       num_free_blocks=4384 - s % 100, hit_tokens=100 * (s % 7 == 0),
                       query_tokens=512 * (s % 7 == 0))
            for s in range(start, start + n)]


@pytest.mark.parametrize("n", [1, 2, 6, 13])
def test_peaks_and_bars_keep_the_envelope_of_the_line_through_every_sample(n):
    rng = np.random.default_rng(n)
    x, y = np.arange(1003.0), rng.normal(size=1003)
    px, py = _peaks(x, y, n)
    bx, by = _bars(x, y, n)
    assert py.max() == y.max() and py.min() == y.min() and px[-1] == x[-1]
    if n == 1:
        assert np.array_equal(py, y)
        return
    runs = (len(y) - 1) // n
    for r in range(runs):  # a run and the samples either side: the line crosses into its pixel
        near = y[max(0, r * n - 1):(r + 1) * n + 1]
        assert py[2 * r] == near.max() and py[2 * r + 1] == near.min()
        assert bx[2 * r] == x[r * n] and by[2 * r] == 0 and by[2 * r + 1] == near.max()
    assert np.array_equal(py[2 * runs:], y[runs * n:])  # the last samples as they are


def test_runs_shorter_than_the_datas_period_leave_no_gaps():
    y = np.where(np.arange(10_000) % 7 == 0, 10.0, 8.0)  # a prefill every 7 steps
    runs = (len(y) - 1) // 6
    _, tops = _bars(np.arange(10_000.0), y, 6)
    assert (tops[1 : 2 * runs : 2] == 10).all()
    _, py = _peaks(np.arange(10_000.0), y, 6)
    assert (py[0 : 2 * runs : 2] == 10).all() and (py[1 : 2 * runs : 2] == 8).all()


@pytest.fixture
def timeline(qtbot):
    t = Timeline()
    qtbot.addWidget(t)
    t.resize(1000, 320)
    t.show()
    t.add_records(records(10_000))
    qtbot.waitUntil(lambda: t._pending == 0)
    return t


def test_zoomed_out_the_curves_get_the_min_and_max_of_each_pixel(timeline):
    width = timeline.time_plot.vb.width()
    x, y = timeline.tokens_curve.getData()
    assert len(x) < 2.5 * width  # a pair per run of steps under a pixel, then the last steps
    assert y.max() == 576 and y.min() == 64  # every prefill spike and every plain step
    # The filled plot is drawn as a bar per run, up to the run's max.
    x, y = timeline.total_bars.getData()
    assert len(x) < 2.5 * width and y.max() == pytest.approx(10)
    assert timeline.total_curve.getData()[0] is None or len(timeline.total_curve.getData()[0]) == 0
    assert timeline.active_curve.getData()[1].max() == 9099


def test_zoomed_in_the_curves_get_every_step_in_view(timeline):
    timeline.time_plot.setXRange(5000, 5100, padding=0)
    x, y = timeline.total_curve.getData()
    assert x[0] == 4999 and x[-1] == 5101 and len(x) == 103
    assert len(timeline.total_bars.getData()[0]) == 0
    timeline.time_plot.enableAutoRange(x=True)  # the "A" button: follow the data again
    timeline.grab()
    assert len(timeline.total_bars.getData()[0]) > 0
    assert timeline.tokens_curve.getData()[0][-1] == 9999


def test_a_step_narrower_than_a_pixel_is_drawn_soon_not_at_once(timeline, qtbot):
    timeline.add_records(records(1, 10_000))
    assert timeline._pending == 1 and timeline.data["step"][-1] == 10_000
    assert timeline.tokens_curve.getData()[0][-1] == 9999
    qtbot.waitUntil(lambda: timeline.tokens_curve.getData()[0][-1] == 10_000,
                    timeout=int(MAX_WAIT_S * 1000) + 500)
    # Enough new steps for a pixel are drawn at once.
    timeline.add_records(records(40, 10_001))
    assert timeline._pending == 0 and timeline.tokens_curve.getData()[0][-1] == 10_040


def test_a_hidden_timeline_draws_when_shown(qtbot):
    t = Timeline()
    qtbot.addWidget(t)
    t.add_records(records(100))
    assert t.tokens_curve.getData()[0] is None or len(t.tokens_curve.getData()[0]) == 0
    t.resize(800, 300)
    t.show()
    assert len(t.tokens_curve.getData()[0]) == 100


def test_grid_lines_sit_on_the_axis_ticks(timeline):
    timeline.grab()
    _, y = timeline.grids[3].item.getData()  # the hit-rate plot: fixed ticks
    assert sorted(set(y.tolist())) == [0, 50, 100]
    (x0, x1), (y0, y1) = timeline.token_plot.vb.viewRange()
    x, y = timeline.grids[1].item.getData()
    assert set(x.tolist()) == {x0, x1} and all(y0 <= v <= y1 for v in y) and len(set(y)) >= 2


def test_a_click_selects_the_step_under_it(timeline, qtbot):
    vb = timeline.block_plot.vb

    class Click:
        def __init__(self, x):
            self.x = x

        def scenePos(self):  # noqa: N802 - pyqtgraph's event API
            return vb.mapViewToScene(QPointF(self.x, 9000))

    for x, nearest in ((4321.2, 4321), (4321.7, 4322)):  # steps are points at integer x
        with qtbot.waitSignal(timeline.step_clicked) as got:
            timeline._on_click(Click(x))
        assert got.args == [nearest]


def test_the_tokens_axis_starts_at_zero_when_every_step_has_the_same_count(qtbot):
    t = Timeline()
    qtbot.addWidget(t)
    t.resize(1000, 320)
    t.show()
    steady = [StepRecord(step=s, start_s=s * 0.01, prefill_s=0.0, decode_s=0.008,
                         prefill_tokens=0, decode_tokens=1024, batch_size=8,
                         num_active_blocks=90, num_cached_blocks=0, num_free_blocks=10,
                         hit_tokens=0, query_tokens=0) for s in range(40)]
    t.add_records(steady)
    qtbot.waitUntil(lambda: t._pending == 0)
    low, high = t.token_plot.vb.viewRange()[1]
    assert low <= 0 < 1024 <= high < 1200  # not 1023.5 to 1024.5


def drawn(t: Timeline) -> list[str]:
    """Every series whose line is on screen now."""
    names = []
    for name, s in t.series.items():
        x, _ = s.items[0].getData()
        if s.items[0].isVisible() and x is not None and len(x):
            names.append(name)
    return names


def test_a_series_is_in_the_legend_while_shown_and_drawn(timeline):
    t = timeline
    t.add_series("stored", "tokens", "#009e73", "stored blocks", dashed=True)
    assert "stored blocks" not in t.legend  # nothing drawn yet
    t.set_series("stored", [2, 5, 9], [1, 4, 2])
    assert "┅</span>&nbsp;stored blocks" in t.legend and "stored blocks" in t.legend_line.text()
    x, y = t.series["stored"].items[0].getData()
    assert x.tolist() == [2, 5, 9] and y.tolist() == [1, 4, 2]
    assert t.series["stored"].items[0].opts["pen"].style() == Qt.PenStyle.DashLine
    t.show_series("stored", False)
    assert "stored blocks" not in t.legend and not t.series["stored"].items[0].isVisible()
    t.show_series("stored")
    t.set_series_label("stored", "blocks stored")
    assert "blocks stored" in t.legend
    t.set_series_label("stored")
    assert "stored blocks" in t.legend
    with pytest.raises(ValueError):
        t.add_series("stored", "tokens", "#000000", "again")
    with pytest.raises(ValueError):
        t.add_series("other", "no such plot", "#000000", "other")
    t.clear()  # a new run: the data goes, the series stays
    assert t.series_data("stored")[0].tolist() == [] and "stored blocks" not in t.legend


def test_every_line_drawn_is_in_the_legend(timeline):
    t = timeline
    t.show_frame(Frame(dead_counts=(np.array([0, 10, 19]), np.array([0, 3, 1]))))
    t.add_series("ttft", "time", "#0072b2", "TTFT ms")
    t.set_series("ttft", [3], [12.0])
    for name in drawn(t):
        assert t.series[name].label in t.legend, name
    assert "dead (unreachable)" in t.legend  # the dashed magenta line says what it is
    for name in ("prefill", "decode", "tokens", "active"):
        t.show_series(name, False)
    t.show_batch_axis(False)
    assert not t.token_plot.getAxis("right").style["showValues"]
    assert "batch" not in t.legend and "prefill" not in t.legend
    assert set(drawn(t)) <= {"cached", "free", "hit", "dead", "ttft"}
    t.show_batch_axis(True)
    assert t.token_plot.getAxis("right").style["showValues"] and "batch" in t.legend


def test_series_move_with_the_wall_clock_axis_and_plots_are_retitled(timeline):
    t = timeline
    t.add_series("kv", "hit", "#7f3fbf", "KV usage %")
    t.set_series("kv", [0, 10], [5, 50])
    t.set_wall_clock(True)
    assert t.series["kv"].items[0].getData()[0].tolist() == pytest.approx([0.0, 0.1])
    assert t.series_data("kv")[0].tolist() == [0, 10]  # what was set: steps
    t.set_wall_clock(False)
    assert t.series["kv"].items[0].getData()[0].tolist() == [0, 10]
    t.set_axis_label("tokens", "per step")
    assert t.token_plot.getAxis("left").labelText == "per step"
    t.set_axis_label("tokens")
    assert t.token_plot.getAxis("left").labelText == "tokens"
