"""Workload files and the runner: parsing (every field, prefixes, errors with line numbers), the
shipped workloads, arrival timing, follows chains that really reuse the previous answer's blocks,
stop / skip, and the run summary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.engine import Engine, EngineConfig, SamplingParams
from kvscope.engine.models.load import load_model
from kvscope.lab.workload import WorkloadError, load_workload, parse_workload
from kvscope.lab.workload_run import WorkloadRunner, percentile, summarize

WORKLOADS = Path(__file__).resolve().parents[2] / "resources" / "workloads"
SHIPPED = ("shared_system_prompt", "multi_turn_chat", "eviction_pressure", "two_tenants",
           "chat_conversations", "demo", "long_context")
BS = 4


def jsonl(*rows) -> str:
    return "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows)


class FakeClock:
    """Time stands still while the engine steps and moves only when the runner sleeps."""

    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def tiny_engine(tiny_llama):
    def make(**kw):
        cfg = dict(block_size=BS, num_blocks=256, max_num_batched_tokens=64)
        cfg.update(kw)
        return Engine(load_model(tiny_llama[0]), EngineConfig(**cfg))
    return make


@pytest.fixture(scope="module")
def demo():
    return load_model("demo")


def ids(n, start=3):
    return [start + (7 * i) % 300 for i in range(n)]


# ----------------------------------------------------------------------------------- parsing
def test_every_field_is_parsed():
    w = parse_workload(jsonl(
        "# a comment",
        {"define_prefix": "sys", "text": "You are terse. "},
        "",
        {"arrival_s": 1.5, "prompt": "Hi", "prefix": "sys", "max_tokens": 7, "temperature": 0.5,
         "top_k": 3, "top_p": 0.9, "seed": 11, "n": 2, "stop": "\n", "ignore_eos": True,
         "cache_salt": "tenant-a", "id": 5},
        {"prompt_ids": [4, 5, 6], "follows": "5", "stop": ["a", "b"], "seed": None},
    ), source="w.jsonl")
    assert w.prefixes == {"sys": "You are terse. "}
    a, b = w.requests
    assert (a.line, a.arrival_s, a.prompt, a.prompt_ids, a.prefix, a.prefix_text) == \
        (4, 1.5, "Hi", None, "sys", "You are terse. ")
    assert a.params == SamplingParams(max_tokens=7, temperature=0.5, top_k=3, top_p=0.9, seed=11,
                                      n=2, stop=["\n"], ignore_eos=True)
    assert (a.cache_salt, a.id, a.follows) == ("tenant-a", "5", None)
    assert (b.line, b.arrival_s, b.prompt, b.prompt_ids, b.follows, b.id) == \
        (5, 0.0, None, [4, 5, 6], "5", None)
    assert b.params == SamplingParams(stop=["a", "b"])
    assert not b.needs_tokenizer and a.needs_tokenizer


BAD = [
    ('{"prompt": "a"}\n{"prompt": "b", "promt": 1}', 2, "unknown key 'promt'"),
    ('{"prompt": "a"}\n\n{"max_tokens": 4}', 3, "missing 'prompt'"),
    ('{"prompt": "a", "prompt_ids": [1]}', 1, "exactly one of"),
    ('{"prompt": "a", "prefix": "sys"}', 1, "unknown prefix 'sys'"),
    ('{"prompt": "a", "follows": "x"}', 1, "follows unknown id 'x'"),
    ('{"prompt": "a", "follows": "x"}\n{"prompt": "b", "id": "x"}', 1, "follows unknown id"),
    ('{"prompt": "a"}\n{"prompt": "b",}', 2, "bad JSON"),
    ('["prompt", "a"]', 1, "expected a JSON object"),
    ('{"prompt": "a", "max_tokens": "10"}', 1, "max_tokens must be an integer"),
    ('{"prompt": "a", "n": true}', 1, "n must be an integer"),
    ('{"prompt": "a", "temperature": -1}', 1, "temperature must be a finite number >= 0"),
    ('{"prompt": "a", "max_tokens": 0}', 1, "max_tokens must be at least 1"),
    ('{"prompt": "a", "arrival_s": -2}', 1, "arrival_s must be a number of seconds in [0, "),
    ('{"prompt_ids": [1, -3]}', 1, "prompt_ids must be a list of integer token ids"),
    ('{"prompt": ""}', 1, "empty prompt"),
    ('{"prompt": "a", "id": 1}\n{"prompt": "b", "id": "1"}', 2, "id '1' is used"),
    ('{"define_prefix": "p", "text": "x"}\n{"define_prefix": "p", "text": "y"}', 2,
     "defined twice"),
    ('{"define_prefix": "p"}', 1, "needs a non-empty string 'text'"),
    ('{"define_prefix": "p", "text": "x", "prompt": "a"}', 1, "unknown key 'prompt'"),
    ('{"define_prefix": "p", "text": "x"}\n{"prompt": "a", "id": 1}\n'
     '{"prompt": "b", "follows": 1, "prefix": "p"}', 3, "cannot be combined"),
]


@pytest.mark.parametrize("text, line, message", BAD)
def test_bad_lines_name_the_line(text, line, message):
    with pytest.raises(WorkloadError) as info:
        parse_workload(text, source="w.jsonl")
    assert str(info.value).startswith(f"w.jsonl:{line}: ")
    assert message in str(info.value)


def test_empty_and_unreadable_files(tmp_path):
    with pytest.raises(WorkloadError, match="no requests"):
        parse_workload("# only a comment\n", source="w.jsonl")
    with pytest.raises(WorkloadError, match="cannot read workload"):
        load_workload(tmp_path / "missing.jsonl")
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe{")
    with pytest.raises(WorkloadError, match="cannot read workload"):
        load_workload(tmp_path / "bin.jsonl")


def test_shipped_workloads_parse():
    assert sorted(p.stem for p in WORKLOADS.glob("*.jsonl")) == sorted(SHIPPED)
    for name in SHIPPED:
        w = load_workload(WORKLOADS / f"{name}.jsonl")
        assert w.source == f"{name}.jsonl" and len(w) >= 6
    chat = load_workload(WORKLOADS / "multi_turn_chat.jsonl")
    assert sum(r.follows is not None for r in chat.requests) >= 3
    tenants = load_workload(WORKLOADS / "two_tenants.jsonl")
    assert {r.cache_salt for r in tenants.requests} == {"tenant-a", "tenant-b"}


def test_workload_module_does_not_import_torch():
    code = "import sys, kvscope.lab.workload; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)


# ----------------------------------------------------------------------------------- running
def test_arrivals_are_submitted_in_time_order_sleeping_while_idle(tiny_engine):
    engine = tiny_engine()
    w = parse_workload(jsonl(
        {"arrival_s": 10, "prompt_ids": ids(5), "max_tokens": 3, "ignore_eos": True},
        {"arrival_s": 0, "prompt_ids": ids(6), "max_tokens": 3, "ignore_eos": True},
        {"arrival_s": 5, "prompt_ids": ids(7), "max_tokens": 3, "ignore_eos": True},
        {"arrival_s": 5, "prompt_ids": ids(8), "max_tokens": 3, "ignore_eos": True},
    ))
    clock = FakeClock()
    progress = []
    res = WorkloadRunner(engine, w, on_progress=lambda d, t: progress.append((d, t)),
                         clock=clock, sleep=clock.sleep).run()
    assert clock.sleeps == [5.0, 5.0]
    assert [x.submitted_s for x in res.lines] == [10.0, 0.0, 5.0, 5.0]
    # engine ids follow submission order: arrival, then file order
    assert [x.request_id for x in res.lines] == [3, 0, 1, 2]
    assert [engine.requests[x.request_id].prompt_token_ids for x in res.lines] == \
        [ids(5), ids(6), ids(7), ids(8)]
    assert progress == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]
    assert all(len(x.outputs) == 1 and x.outputs[0].finish_reason == "length"
               and len(x.outputs[0].token_ids) == 3 for x in res.lines)
    assert [o.request_id for o in res.outputs] == [3, 0, 1, 2]
    assert res.num_steps == len(engine.step_records) and res.end_s == 10.0


def test_requests_that_fall_due_during_a_step_go_in_arrival_order(tiny_engine):
    engine = tiny_engine()
    clock = FakeClock()
    step = engine.step

    def slow_step():  # each engine step takes one (fake) second
        clock.now += 1.0
        return step()

    engine.step = slow_step
    w = parse_workload(jsonl(
        {"prompt_ids": ids(5), "max_tokens": 10, "ignore_eos": True},
        {"arrival_s": 3.5, "prompt_ids": ids(6), "max_tokens": 2},
        {"arrival_s": 3.2, "prompt_ids": ids(7), "max_tokens": 2},
    ))
    res = WorkloadRunner(engine, w, clock=clock, sleep=clock.sleep).run()
    assert clock.sleeps == []
    assert [x.submitted_s for x in res.lines] == [0.0, 4.0, 4.0]
    assert [x.request_id for x in res.lines] == [0, 2, 1]


def test_follows_resends_history_and_reuses_the_answer_blocks(tiny_engine):
    engine = tiny_engine()
    w = parse_workload(jsonl(
        {"id": "t1", "prompt_ids": ids(10), "max_tokens": 7, "n": 2, "temperature": 1.0,
         "seed": 3, "ignore_eos": True},
        {"id": "t2", "follows": "t1", "prompt_ids": [5, 6, 7], "max_tokens": 6,
         "ignore_eos": True},
        {"id": "t3", "follows": "t2", "arrival_s": 0.5, "prompt_ids": [8, 9],
         "max_tokens": 5, "ignore_eos": True},
        {"prompt_ids": ids(9, start=50), "max_tokens": 4, "ignore_eos": True},
    ))
    clock = FakeClock()
    res = WorkloadRunner(engine, w, clock=clock, sleep=clock.sleep).run()
    t1, t2, t3, other = res.lines
    assert len(t1.outputs) == 2 and t1.outputs[1].parent_id == t1.request_id
    assert other.submitted_s == 0.0 and t2.submitted_s == 0.0 and t3.submitted_s == 0.5
    assert clock.sleeps == [0.5]  # t3 waited for its own arrival after t2 finished
    for prev, line in ((t1, t2), (t2, t3)):
        first = engine.requests[prev.request_id]
        history = first.prompt_token_ids + first.output_token_ids
        req = engine.requests[line.request_id]
        assert req.prompt_token_ids == history + line.request.prompt_ids
        assert engine.requests[line.request_id].metrics.first_scheduled_s > \
            first.metrics.finished_s
        # every full block of the previous prompt + answer (its last token was never computed)
        # comes from the cache
        assert line.outputs[0].num_cached_tokens == (len(history) - 1) // BS * BS
        assert line.outputs[0].num_cached_tokens > len(first.prompt_token_ids)


def test_text_prompts_prefixes_and_chat_turns_on_the_demo_model(demo):
    engine = Engine(demo, EngineConfig(num_blocks=512))
    tok = engine.tokenizer
    w = parse_workload(jsonl(
        {"define_prefix": "sys", "text": "You answer questions about Python lists. "},
        {"id": "a", "prefix": "sys", "prompt": "User: what is a list?\nAssistant:",
         "max_tokens": 20, "ignore_eos": True},
        {"follows": "a", "prompt": "\nUser: and a tuple?\nAssistant:", "max_tokens": 4},
        {"prefix": "sys", "prompt_ids": [40, 41, 42], "max_tokens": 2},
    ))
    res = WorkloadRunner(engine, w).run()
    a, b, c = (engine.requests[x.request_id] for x in res.lines)
    assert a.prompt_token_ids == tok.encode("You answer questions about Python lists. "
                                            "User: what is a list?\nAssistant:")
    tail = tok.encode("\nUser: and a tuple?\nAssistant:", add_special_tokens=False)
    assert b.prompt_token_ids == a.prompt_token_ids + a.output_token_ids + tail
    assert tail[0] != tok.encode("x")[0]  # no BOS in the middle of the history
    assert c.prompt_token_ids == tok.encode("You answer questions about Python lists. ") + \
        [40, 41, 42]
    assert res.lines[1].outputs[0].num_cached_tokens == (a.num_tokens - 1) // 16 * 16


def test_shipped_multi_turn_chat_reuses_each_previous_turn(demo):
    engine = Engine(demo, EngineConfig(num_blocks=512))
    w = load_workload(WORKLOADS / "multi_turn_chat.jsonl")
    res = WorkloadRunner(engine, w).run()
    by_id = {x.request.id: x for x in res.lines}
    followers = [x for x in res.lines if x.request.follows]
    assert len(followers) >= 3
    for line in followers:
        prev = engine.requests[by_id[line.request.follows].request_id]
        assert line.outputs[0].num_cached_tokens == (prev.num_tokens - 1) // 16 * 16
    assert all(x.outputs[0].finish_reason in ("length", "eos", "stop") for x in res.lines)


def test_followers_of_a_rejected_request_are_skipped(tiny_engine):
    engine = tiny_engine()
    w = parse_workload(jsonl(
        {"id": "big", "prompt_ids": ids(600), "max_tokens": 2},  # beyond the 512-token context
        {"id": "next", "follows": "big", "prompt_ids": [5], "max_tokens": 2},
        {"follows": "next", "prompt_ids": [6], "max_tokens": 2},
        {"prompt_ids": ids(5), "max_tokens": 2, "ignore_eos": True},
    ))
    res = WorkloadRunner(engine, w).run()
    assert res.lines[0].outputs[0].finish_reason == "rejected"
    assert res.lines[1].skipped == "follows 'big', which was rejected"
    assert res.lines[2].skipped == "follows 'next', which was skipped"
    assert res.lines[1].request_id is None and res.lines[3].outputs[0].finish_reason == "length"
    s = summarize(engine, res)
    assert (s.num_lines, s.num_requests, s.num_finished, s.num_rejected, s.num_skipped) == \
        (4, 2, 1, 1, 2)


def test_stop_cancels_in_flight_and_skips_the_rest(tiny_engine):
    engine = tiny_engine()
    w = parse_workload(jsonl(
        {"prompt_ids": ids(8), "max_tokens": 50, "ignore_eos": True, "n": 2, "seed": 1,
         "temperature": 1.0},
        {"prompt_ids": ids(9), "max_tokens": 50, "ignore_eos": True},
        {"arrival_s": 3600, "prompt_ids": ids(10), "max_tokens": 5},
    ))
    runner = WorkloadRunner(engine, w)
    for _ in range(5):
        assert runner.advance() == 0.0
    other = engine.add_request(ids(7), SamplingParams(max_tokens=40, ignore_eos=True))
    runner.stop()
    res = runner.result
    assert res.cancelled
    assert [[o.finish_reason for o in x.outputs] for x in res.lines[:2]] == \
        [["cancelled", "cancelled"], ["cancelled"]]  # the forked sample too
    assert res.lines[2].skipped and res.lines[2].request_id is None
    # a request that is not the workload's is left running
    assert not engine.requests[other].finished and engine.has_unfinished()
    s = summarize(engine, res)
    assert (s.num_finished, s.num_cancelled, s.num_skipped) == (0, 3, 1)
    assert runner.advance() is None


def test_a_model_without_tokenizer_needs_prompt_ids(tiny_engine):
    engine = tiny_engine()
    assert engine.tokenizer is None
    with pytest.raises(WorkloadError, match=r"w.jsonl:2: the model has no tokenizer"):
        WorkloadRunner(engine, parse_workload(jsonl({"prompt_ids": [4]}, {"prompt": "hi"}),
                                              source="w.jsonl"))


def test_summary_matches_the_engine_records(tiny_engine):
    engine = tiny_engine(num_blocks=24)
    shared = ids(24)
    rows = [{"prompt_ids": shared + ids(6 + k, start=100 + k), "max_tokens": 12,
             "ignore_eos": True, "cache_salt": "a" if k % 3 else "b"} for k in range(8)]
    rows[5]["n"] = 2  # a forked sample is not an admission: it must not count as a hit
    res = WorkloadRunner(engine, parse_workload(jsonl(*rows))).run()
    s = summarize(engine, res)
    snap = engine.snapshot()
    assert (s.hit_tokens, s.query_tokens) == (snap.hit_tokens, snap.query_tokens)
    assert (s.num_requests_hit, s.num_requests_queried) == \
        (snap.num_requests_hit, snap.num_requests_queried)
    assert s.num_evictions == snap.num_evicted_blocks == engine.manager.pool.num_evicted > 0
    assert s.num_preemptions == sum(r.metrics.num_preemptions for r in engine.requests.values())
    assert s.num_preemptions > 0
    assert s.num_finished == 9 and s.num_requests == 9 and s.output_tokens == 9 * 12
    assert s.prompt_tokens == sum(len(r["prompt_ids"]) for r in rows)
    assert s.num_warmup_steps == 2 and s.num_steps == len(engine.step_records)
    assert 0 < s.output_tokens_per_s < s.total_tokens_per_s
    ttfts = sorted(r.metrics.ttft_s for r in engine.requests.values() if r.parent_id is None)
    assert s.ttft_p50_s == pytest.approx((ttfts[3] + ttfts[4]) / 2)


def test_a_runner_that_misses_its_outputs_says_so(tiny_engine):
    engine = tiny_engine()
    runner = WorkloadRunner(engine, parse_workload(jsonl({"prompt_ids": ids(5),
                                                          "max_tokens": 2})))
    runner.advance()
    while engine.has_unfinished():  # someone else steps the engine
        engine.step()
    with pytest.raises(RuntimeError, match="workload stalled"):
        runner.advance()
