"""A workload's cache breakpoint ("the system prompt") travels with the request into the
recorded session, and the lab's billing caches only up to it."""

from __future__ import annotations

import pytest

from kvscope.engine.config import EngineConfig
from kvscope.lab import billing
from kvscope.lab.workload import WorkloadError, parse_workload
from kvscope.lab.workload_run import WorkloadRunner
from kvscope.sessions import Recorder
from kvscope.sessions.lab_input import load_lab_input

SYSTEM = "You answer questions about Python lists, tuples and sets, briefly. " * 8
WORKLOAD = f"""
{{"define_prefix": "system", "text": "{SYSTEM}"}}
{{"prefix": "system", "prompt": " What is a list, and when would I use one instead?",
  "cache_breakpoint": "prefix", "max_tokens": 2, "ignore_eos": true}}
{{"arrival_s": 0.05, "prefix": "system", "prompt": " And a tuple? Say why in one line.",
  "cache_breakpoint": "prefix", "max_tokens": 2, "ignore_eos": true}}
{{"arrival_s": 0.1, "prompt": "Unrelated, with no breakpoint: how do sets hash their items?",
  "max_tokens": 2, "ignore_eos": true}}
""".replace("\n  ", " ")


def test_the_system_prompt_breakpoint_is_recorded_and_billed(tmp_path):
    from kvscope.engine import Engine

    path = tmp_path / "s.kvscope"
    engine = Engine.from_pretrained("demo", EngineConfig(num_blocks=128, block_size=16))
    with Recorder(path, engine):
        WorkloadRunner(engine, parse_workload(WORKLOAD)).run()
    trace = load_lab_input(path)
    cut = len(engine.tokenizer.encode(SYSTEM))
    assert [r.breakpoint for r in trace.requests] == [cut, cut, None]
    prices = billing.Prices(min_tokens=0)
    bill = billing.run(trace, 300, prices)
    free = trace.requests[2].input_length - 1  # no breakpoint: its full blocks, last token out
    assert bill.written_tokens == cut // 16 * 16 + free // 16 * 16
    assert bill.read_tokens == cut // 16 * 16
    without = [r.__class__(r.arrival_s, r.input_length, r.output_length, r.nodes)
               for r in trace.requests]
    trace.requests = without
    assert billing.run(trace, 300, prices).written_tokens > bill.written_tokens


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "hi", "cache_breakpoint": "prefix"}', 'cache_breakpoint "prefix" needs'),
    ('{"prompt": "hi", "cache_breakpoint": -3}', "cache_breakpoint must be"),
    ('{"prompt": "hi", "cache_breakpoint": "end"}', "cache_breakpoint must be"),
])
def test_bad_breakpoints_name_the_line(line, message):
    with pytest.raises(WorkloadError, match=message):
        parse_workload(line, "w.jsonl")
