"""The built-in hybrid model (`demo-hybrid`: the demo's weights as a Ministral, a 128-token window
on layers 0 and 2) and the long-context workload F5 plays on it.

The model gives transformers' MinistralForCausalLM tokens on the same weights and config, past
the window, with a prefix hit; the workload, run at the window's pace, frees window blocks while
requests run, hits in both groups early, and ends with a hit that the window group cuts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from model_testutil import hf_greedy
from test_demo_workload import PACE_S, PacedClock

from kvscope.engine import Engine, EngineConfig, SamplingParams
from kvscope.engine import events as ev
from kvscope.engine import explain as ex
from kvscope.engine.models.load import BUILT_IN, load_model, resolve_model
from kvscope.lab.workload import load_workload
from kvscope.lab.workload_run import WorkloadRunner

WORKLOAD = Path(__file__).resolve().parents[2] / "resources" / "workloads" / "long_context.jsonl"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """transformers' Ministral on the demo's weights, read from a folder whose config.json is
    the demo's with demo-hybrid's fields written over it."""
    demo = resolve_model("demo")
    folder = tmp_path_factory.mktemp("ministral")
    cfg = {**json.loads((demo / "config.json").read_text()), **BUILT_IN["demo-hybrid"][1]}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "model.safetensors").symlink_to(demo / "model.safetensors")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_demo_hybrid_is_two_groups_and_not_the_demo():
    hybrid, demo = load_model("demo-hybrid"), load_model("demo")
    assert hybrid.config.layer_windows == (128, None, 128, None)
    assert hybrid.fingerprint != demo.fingerprint  # its cached blocks never hit the demo's


def test_greedy_tokens_equal_transformers_ministral_past_the_window_with_a_prefix_hit(reference):
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 2048, (200,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 2048, (n,), generator=g).tolist() for n in (90, 140)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [hf_greedy(reference, p, 12)[0] for p in prompts]
    engine = Engine.from_pretrained("demo-hybrid", EngineConfig(num_blocks=128, dtype="float32"))
    got = engine.generate(prompts, params)
    second = engine.generate([prompts[1]], params)[0]  # the whole prompt cached by now
    assert [o.token_ids for o in got] == want
    assert second.token_ids == want[1] and second.num_cached_tokens >= 320
    off = Engine.from_pretrained("demo-hybrid", EngineConfig(
        num_blocks=128, dtype="float32", enable_prefix_caching=False)).generate(prompts, params)
    assert [o.token_ids for o in off] == want


def test_the_long_context_demo_frees_window_blocks_and_ends_with_a_window_cut_hit():
    engine = Engine.from_pretrained("demo-hybrid", EngineConfig(num_blocks=None))
    clock = PacedClock()
    runner = WorkloadRunner(engine, load_workload(WORKLOAD), clock=clock, sleep=clock.sleep)
    freed_while_running, finished = 0, set()
    evicted = 0

    def on_update(u):
        nonlocal freed_while_running, evicted
        for e in u.events:
            if e.kind == ev.OUT_OF_WINDOW and e.request_id not in finished:
                freed_while_running += len(e.blocks)
            elif e.kind == ev.FINISHED:
                finished.add(e.request_id)
            elif e.kind == ev.EVICTED:
                evicted += len(e.blocks)

    engine.subscribe(on_update)
    while (delay := runner.advance()) is not None:
        clock.now += PACE_S if delay == 0.0 else 0.0
    assert 25 <= clock.now <= 45, clock.now
    assert freed_while_running >= 12 * 80  # ~90 window blocks of each 1,500-token document
    assert evicted > 0
    lines = runner.result.lines
    assert {o.finish_reason for line in lines for o in line.outputs} == {"length"}
    doc0 = sorted((line.request.arrival_s, engine.explain_miss(line.request_id))
                  for line in lines if line.request.prompt.startswith("Document 0."))
    assert [t for t, _ in doc0] == [0.0, 1.0, 3.0, 12.0, 24.0]
    assert [why.reason for _, why in doc0[1:4]] == [ex.FULL_HIT] * 3
    late = doc0[-1][1]
    assert late.reason == ex.WINDOW_CUT, late.message
    assert late.cut_by_group == "sliding window 128"
    assert late.reach_blocks == 48 and late.group_blocks_needed == 8  # 768 tokens; cdiv(127, 16)
    assert late.group_blocks_found < 8 and late.num_hit_blocks < late.reach_blocks
