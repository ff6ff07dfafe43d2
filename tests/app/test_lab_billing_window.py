"""Prompt-cache billing in the Lab dock: the TTL and the prices typed in, a preset picked with
the keyboard, Run; the dock then shows the bill `kvscope lab --ttl` computes, the prefixes and
the cost against TTL; "Open the replay" shows the run under the TTL, and "Why did this miss?"
on a request whose prefix expired says so. Screenshot: tests/artifacts/lab_billing.png."""

from __future__ import annotations

from pathlib import Path

import pyqtgraph as pg
from PySide6.QtCore import Qt
from test_captions_truth import click_row
from test_lab_window import window  # noqa: F401 (the Lab dock's window, no model)

from kvscope.app.sources.lab import LabSource
from kvscope.lab import billing
from kvscope.lab.traces import load_trace

DATA = Path(__file__).resolve().parents[1] / "data"
HEAD = DATA / "mooncake_conversation_head800.jsonl"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
LIMIT = 300  # (its first 120 requests have no prefix back after more than 5 s)
TTL = 5


def type_into(qtbot, box, text: str) -> None:
    box.setFocus()
    box.selectAll()
    qtbot.keyClicks(box, text)
    qtbot.keyClick(box, Qt.Key_Tab)


def test_the_dock_bills_a_trace_under_a_ttl_as_the_cli_does(window, qtbot):  # noqa: F811
    w, lab = window, window.lab
    w.docks["lab"].toggleViewAction().trigger()
    qtbot.keyClicks(lab.path_edit, str(HEAD))
    type_into(qtbot, lab.limit, str(LIMIT))
    controls = lab.billing
    controls.preset.setFocus()
    qtbot.keyClick(controls.preset, Qt.Key_Down)  # anthropic-5m -> anthropic-1h
    assert controls.fields["write"].value() == 2.0
    type_into(qtbot, controls.ttl, str(TTL))
    type_into(qtbot, controls.fields["read"], "0.2")
    type_into(qtbot, controls.min_tokens, "2048")
    qtbot.mouseClick(lab.run_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: lab.run is None, timeout=120_000)
    assert lab.progress.value() == lab.progress.maximum() == 1 + len(billing.TTL_GRID_S)

    prices = billing.Prices(3.0, 2.0, 0.2, 2048, 15.0)
    bill = billing.run(load_trace(HEAD, limit=LIMIT), TTL, prices)
    text = lab.verdict.text()
    assert f"${bill.cost:,.4f} with prompt caching" in text
    assert f"${bill.cost_without_cache:,.4f} without" in text
    assert f"{bill.request_hit_ratio:.1%} of requests, {bill.token_hit_ratio:.1%} of tokens" \
        in text
    assert f"TTL {TTL} s" in text and "more than 1.25 hits per write" in text
    table = lab.bill_view.table
    assert table.isVisible() and not lab.table.isVisible()
    top = max(bill.prefixes, key=lambda x: abs(x.saving(prices)))
    assert table.item(0, 0).text() == f"{top.start_token:,}–{top.end_token:,}"
    assert table.item(0, 3).text() == ("yes" if top.paid(prices) else "no")
    lines = [i for i in lab.plot.getPlotItem().items if isinstance(i, pg.PlotDataItem)]
    assert len(lines[0].xData) == len(billing.TTL_GRID_S)
    assert list(lines[1].yData) == [bill.cost_without_cache] * 2
    ARTIFACTS.mkdir(exist_ok=True)
    qtbot.wait(50)
    w.docks["lab"].grab().save(str(ARTIFACTS / "lab_billing.png"))

    qtbot.mouseClick(lab.open_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: isinstance(w.source, LabSource), timeout=60_000)
    replay = w.source.replay
    assert (w.source.policy, replay.ttl_s, w.source.pool_blocks) == ("ttl", TTL, bill.pool_blocks)
    rid = min(r for r, why in replay.explanations.items() if why.reason == "expired")
    why = replay.explanations[rid]
    assert why.idle_s > TTL
    w.replay_bar.set_step(rid)
    click_row(w, qtbot, rid)
    qtbot.mouseClick(w.requests.explain_button, Qt.LeftButton)
    shown = w.details.text.toPlainText()
    assert f"expired {why.idle_s:,.0f} s after its last use (TTL {TTL} s)" in shown
    w.grab().save(str(ARTIFACTS / "lab_billing_expired.png"))
