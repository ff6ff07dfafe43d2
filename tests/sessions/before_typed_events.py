"""The scenario behind `tests/data/session_before_typed_events.kvscope` (recorded at commit
5a11464, before events carried typed fields and before the one lifecycle fold): a prefix hit, a
rejection, a preemption, a cancellation, evictions, a salted request and one left waiting.

`python tests/sessions/before_typed_events.py OUT.kvscope` records it again and writes
OUT.rows.json: the replay source's rows at every step and the engine process's request table
after every action (times left out: they differ from run to run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

TABLE_TIMES = ("ttft_s", "tpot_s")


def run(out: Path) -> list[list[dict]]:
    """Record the scenario to `out`; return the request table's rows after each action."""
    from kvscope.app.host.server import RequestTable
    from kvscope.engine import Engine, EngineConfig, SamplingParams
    from kvscope.engine.stream import StepQueue
    from kvscope.sessions import Recorder

    engine = Engine.from_pretrained("demo", EngineConfig(num_blocks=12, block_size=16))
    queue, table, live = StepQueue(), RequestTable(), []
    engine.subscribe(queue)

    def shot():
        for u in queue.drain():
            table.apply(u)
        live.append([{k: v for k, v in vars(r).items() if k not in TABLE_TIMES}
                     for r in table.rows.values()])

    def add(prompt, params, salt=None):
        rid = engine.add_request(prompt, params, salt)
        table.set_output(engine.request_output(rid))
        shot()
        return rid

    def step():
        engine.step()
        shot()

    shared = [100 + i for i in range(40)]
    rec = Recorder(out, engine, record_text=True, keyframe_every=8).start()
    ten = SamplingParams(max_tokens=10, ignore_eos=True)
    thirty = SamplingParams(max_tokens=30, ignore_eos=True)
    ids = [add(shared + [7, 8, 9], ten)]
    step()
    step()
    ids.append(add(shared + [5, 6], ten))  # a prefix hit
    ids.append(add([], ten))  # rejected: an empty prompt
    ids.append(add([300 + i for i in range(60)], thirty))
    ids.append(add([500 + i for i in range(50)], thirty))  # the pool runs out: a preemption
    for _ in range(6):
        step()
    engine.cancel(ids[1])  # while it runs
    table.set_output(engine.request_output(ids[1]))
    shot()
    add(shared + [1], SamplingParams(max_tokens=3, ignore_eos=True), "tenant")
    for _ in range(200):
        if not engine.has_unfinished():
            break
        step()
    add(shared + [2, 3], ten)  # left waiting: no step runs it
    rec.close()
    return live


def replay_rows(path: Path) -> dict[str, list[dict]]:
    """The replay source's rows at every step of a session (JSON keys: the steps)."""
    from kvscope.app.sources.replay import ReplaySource
    from kvscope.sessions import SessionReader

    with SessionReader(path) as reader:
        source = ReplaySource(reader)
        return {str(s): [vars(r) for r in source.rows_at(s, reader.snapshot_at(s))]
                for s in reader.step_numbers}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    live = run(out)
    out.with_suffix(".rows.json").write_text(json.dumps(
        {"replay_rows": replay_rows(out), "live_rows": live}, sort_keys=True))
