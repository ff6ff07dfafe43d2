"""The Lab panel with a host tier, driven with keys and clicks: the host size typed beside the
pool size reaches the worker, the table splits each tiered row's hits by tier as the lab computes
them, the verdict gives the sizing line, and "Open the replay" opens the selected tiered row's
what-if run with its host tier (the pool's second grid). Screenshot: tests/artifacts/."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QPoint, Qt
from test_lab_window import HEAD, table, window  # noqa: F401 - the window fixture

from kvscope.app.panels.lab_panel import COLUMNS, TIER_COLUMNS
from kvscope.app.sources.lab import LabSource
from kvscope.lab import report, tiers
from kvscope.lab.traces import load_trace

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
LIMIT, POOL, HOST = 200, 1000, 60000


def type_into(qtbot, edit, text: str) -> None:
    edit.selectAll()
    qtbot.keyClick(edit, Qt.Key_Delete)
    qtbot.keyClicks(edit, text)


def test_the_lab_panel_runs_a_host_tier_and_shows_its_hit_ratio(window, qtbot):  # noqa: F811
    w, lab = window, window.lab
    w.docks["lab"].toggleViewAction().trigger()
    type_into(qtbot, lab.path_edit, str(HEAD))
    type_into(qtbot, lab.sizes_edit, str(POOL))
    type_into(qtbot, lab.host_edit, f"{HOST}")
    lab.limit.selectAll()
    qtbot.keyClicks(lab.limit, str(LIMIT))
    belady = lab.policy_boxes["belady"]
    qtbot.mouseClick(belady, Qt.LeftButton, pos=QPoint(8, belady.height() // 2))  # lru only
    assert not belady.isChecked()
    qtbot.mouseClick(lab.run_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: lab.run is None, timeout=60_000)
    assert lab.progress.value() == lab.progress.maximum() == 3  # lru, lru + host, infinite

    want, _ = report.run(load_trace(HEAD, limit=LIMIT), [POOL], ["lru"], host_sizes=(HOST,),
                         on_row=lambda r: None)
    tiered = want[1]
    assert tiered.host_blocks == HOST and tiered.host_hit_ratio > 0.005
    shown = table(lab)
    host_col = len(COLUMNS)
    assert not lab.table.isColumnHidden(host_col)
    assert [t[host_col:] for t in shown] == [
        [f"{r.host_blocks:,}" if r.host_blocks else "-", f"{r.device_hit_ratio:.2%}",
         f"{r.host_hit_ratio:.2%}"] for r in want]
    assert shown[1][3] == f"{tiered.token_hit_ratio:.2%}"  # both tiers' hits
    assert "host tier (60,000 blocks, lru) turns" in lab.verdict.text()
    assert f"{100 * tiered.host_hit_ratio:.1f} % from the host" in lab.verdict.text()
    ARTIFACTS.mkdir(exist_ok=True)
    w.docks["lab"].widget().grab().save(str(ARTIFACTS / "lab-panel-host-tier.png"))

    lab.table.selectRow(1)  # the tiered row
    qtbot.mouseClick(lab.open_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: isinstance(w.source, LabSource), timeout=60_000)
    assert w.source.replay.host_blocks == HOST and "host tier 60,000 blocks" in w.source.name
    w.replay_bar.set_step(LIMIT - 1)
    assert w.snapshot.host is not None and w.snapshot.host.num_blocks == HOST
    host_tokens = sum(r.host_cached_tokens for r in w.requests.model.rows)
    assert host_tokens == round(tiered.host_hit_ratio * sum(
        r.input_length for r in load_trace(HEAD, limit=LIMIT).requests))


def test_a_bad_host_size_is_said_and_runs_nothing(window, qtbot):  # noqa: F811
    lab = window.lab
    type_into(qtbot, lab.path_edit, str(HEAD))
    type_into(qtbot, lab.host_edit, "4GiB")
    qtbot.mouseClick(lab.run_button, Qt.LeftButton)
    assert lab.run is None and lab.verdict.text() == \
        "Host sizes must be whole numbers of blocks: '4GiB'"


def test_without_a_host_tier_the_tier_columns_are_hidden(window, qtbot):  # noqa: F811
    lab = window.lab
    lab.show_result([(100, 0.1), (1000, 0.2)], report.run(
        load_trace(HEAD, limit=20), [100], ["lru"], on_row=lambda r: None)[0])
    assert all(lab.table.isColumnHidden(len(COLUMNS) + j) for j in range(len(TIER_COLUMNS)))
    assert "host" not in lab.verdict.text()
    assert tiers  # (the sizing line's module: the verdict's)
