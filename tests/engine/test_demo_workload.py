"""The demo F5 plays, run for real on the demo model and the default CPU pool, with the window's
pace (8 steps a second) on a clock that the steps move: it fills the pool, shares the system
prompt, copies on write and evicts in LRU order, within 20 to 40 paced seconds."""

from __future__ import annotations

from pathlib import Path

from kvscope.engine import Engine
from kvscope.engine import events as ev
from kvscope.engine.config import DEFAULT_CPU_BLOCKS, EngineConfig
from kvscope.lab.workload import load_workload
from kvscope.lab.workload_run import WorkloadRunner

DEMO = Path(__file__).resolve().parents[2] / "resources" / "workloads" / "demo.jsonl"
PACE_S = 1 / 8  # app/window/engine_controls.py DEMO_PACE


class PacedClock:
    """Moves by a step's pace for each engine step, and by the wait when the runner sleeps."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_the_demo_fills_the_default_pool_shares_copies_and_evicts_in_20_to_40_s():
    engine = Engine.from_pretrained("demo", EngineConfig(num_blocks=None))
    assert engine.snapshot().num_blocks == DEFAULT_CPU_BLOCKS
    clock = PacedClock()
    runner = WorkloadRunner(engine, load_workload(DEMO), clock=clock, sleep=clock.sleep)
    kinds: dict = {}
    first_eviction = None
    min_free = DEFAULT_CPU_BLOCKS
    max_shared = 0
    engine.subscribe(lambda u: [kinds.setdefault(e.kind, []).append(e) for e in u.events])
    while (delay := runner.advance()) is not None:
        clock.now += PACE_S if delay == 0.0 else 0.0  # the runner sleeps through arrivals
        snap = engine.snapshot()
        min_free = min(min_free, snap.num_free_blocks)
        max_shared = max(max_shared, snap.num_shared_blocks)
        if first_eviction is None and ev.EVICTED in kinds:
            first_eviction = clock.now
    assert min_free <= DEFAULT_CPU_BLOCKS // 100  # filled
    assert max_shared >= 20  # the ~330-token system prompt's blocks, shared while running
    assert len(kinds.get(ev.COW, [])) >= 2  # the n = 2 samples
    assert len(kinds.get(ev.EVICTED, [])) >= 1 and first_eviction is not None
    assert 20 <= clock.now <= 40, clock.now
    assert 10 <= first_eviction < clock.now
    reasons = {o.finish_reason for line in runner.result.lines for o in line.outputs}
    assert reasons == {"length"}, reasons  # none rejected (too long) or cut short
