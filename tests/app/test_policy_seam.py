"""An eviction policy is one row of kvscope.engine.policies.POLICIES: a dummy row alone is a
CLI choice, an EngineConfig value, a policy the pool obeys, a Lab checkbox, a lab run and a
curve on the lab's plot."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pyqtgraph as pg
import pytest

from kvscope.app.cli.main import build_parser
from kvscope.app.panels.lab_panel import LabPanel
from kvscope.engine import EngineConfig, KVCacheManager, policies
from kvscope.lab import report
from kvscope.lab.traces import load_trace

HEAD = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_head200.jsonl"


class MruCached:
    """The most recently released cached block goes first (the test's dummy policy)."""

    keeps_release_order = False

    def __init__(self):
        self._queue: OrderedDict[int, None] = OrderedDict()

    def push(self, block, pool):
        self._queue[block] = None

    def remove(self, block):
        del self._queue[block]

    def pop(self):
        return self._queue.popitem(last=True)[0]

    def clone(self):
        new = MruCached()
        new._queue = self._queue.copy()
        return new

    def __len__(self):
        return len(self._queue)

    def order(self):
        return list(reversed(self._queue))


@pytest.fixture
def mru(monkeypatch):
    monkeypatch.setitem(policies.POLICIES, "mru", policies.Policy("mru", "newest first",
                                                                  MruCached))
    return "mru"


def test_a_new_policy_row_is_a_cli_choice_and_the_pool_obeys_it(mru):
    args = build_parser().parse_args(["run", "--workload", "x", "--eviction-policy", mru])
    assert args.eviction_policy == mru
    EngineConfig(eviction_policy=mru)  # a valid value
    mgr = KVCacheManager(4, 4, eviction_policy=mru)
    for rid, start in enumerate((0, 100)):  # two requests of one full block each, freed
        mgr.admit(rid, list(range(start, start + 5)))
        mgr.free(rid)
    mgr.admit(2, list(range(200, 209)))  # 3 blocks: the free two, then one cached
    mgr.free(2)
    assert mgr.admit(3, list(range(0, 5))) == 4  # the older block survived: newest went first
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--workload", "x", "--eviction-policy", "nonesuch"])


def test_a_new_policy_row_is_a_lab_checkbox_a_run_and_a_curve(mru, qtbot):
    panel = LabPanel()
    qtbot.addWidget(panel)
    assert mru in panel.policy_boxes
    trace = load_trace(HEAD, limit=40)
    rows, stream = report.run(trace, [500, 2000], ["lru", mru], on_row=lambda r: None)
    assert [r.policy for r in rows if r.policy == mru] == [mru, mru]
    panel.show_result(report.lru_curve(stream, [500, 2000]), rows)
    names = [i.name() for i in panel.plot.getPlotItem().items if isinstance(i, pg.PlotDataItem)]
    assert mru in names
