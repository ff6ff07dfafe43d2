"""Chat lines of a workload: each turn resends the conversation, formatted by SmolLM2's chat
template, and reuses the earlier turns' blocks, the generated answers included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvscope.engine import Engine, EngineConfig
from kvscope.engine.models.load import load_model
from kvscope.lab.workload import WorkloadError, load_workload, parse_workload
from kvscope.lab.workload_run import WorkloadRunner

WORKLOADS = Path(__file__).resolve().parents[2] / "resources" / "workloads"
BS = 16


def jsonl(*rows) -> str:
    return "\n".join(json.dumps(r) for r in rows)


@pytest.fixture
def smollm2(smollm2_model):
    return smollm2_model


def test_turn_three_reuses_turns_one_and_two_and_their_answers(smollm2):
    engine = Engine(smollm2, EngineConfig(block_size=BS, num_blocks=256))
    w = parse_workload(jsonl(
        {"define_prefix": "sys", "text": "You answer in one short sentence."},
        {"id": "t1", "chat": True, "prefix": "sys", "prompt": "What is a list?", "max_tokens": 12},
        {"id": "x1", "chat": True, "prompt": "Say hello.", "max_tokens": 6},
        {"id": "t2", "chat": True, "follows": "t1", "prompt": "And a tuple?", "max_tokens": 12},
        {"id": "t3", "chat": True, "follows": "t2", "prompt": "Which is faster?",
         "max_tokens": 12},
    ))
    res = WorkloadRunner(engine, w).run()
    t1, _, t2, t3 = res.lines
    assert [m["role"] for m in t3.messages] == ["system", "user", "assistant", "user",
                                                "assistant", "user"]
    assert t3.messages[2]["content"] == t1.outputs[0].text != ""
    assert t3.messages[4]["content"] == t2.outputs[0].text != ""
    for prev, line in ((t1, t2), (t2, t3)):
        before = engine.requests[prev.request_id]
        history = list(before.prompt_token_ids) + list(before.output_token_ids)
        prompt = engine.requests[line.request_id].prompt_token_ids
        # The answer re-encoded from its text gives back the generated tokens, so every full
        # block holding KV (all tokens but the last sampled one) is a hit.
        assert list(prompt[:len(history) - 1]) == history[:-1]
        assert line.outputs[0].num_cached_tokens == (len(history) - 1) // BS * BS
    assert t3.outputs[0].num_cached_tokens > len(engine.requests[t1.request_id].prompt_token_ids)


def test_shipped_chat_workload_parses_and_chains_three_conversations():
    w = load_workload(WORKLOADS / "chat_conversations.jsonl")
    assert all(r.chat for r in w.requests)
    assert sum(r.follows is not None for r in w.requests) == 6


def test_chat_line_errors_name_the_line(smollm2):
    bad = {
        "a chat line's prompt is a message": [{"chat": True, "prompt_ids": [1, 2]}],
        "a chat line cannot follow a plain line": [
            {"id": "p", "prompt": "hi"}, {"chat": True, "follows": "p", "prompt": "x"}],
        "chat must be true or false": [{"chat": "yes", "prompt": "x"}],
    }
    for message, rows in bad.items():
        with pytest.raises(WorkloadError, match=f"<workload>:{len(rows)}: {message}"):
            parse_workload(jsonl(*rows))
    demo = Engine(load_model("demo"), EngineConfig(num_blocks=64))
    with pytest.raises(WorkloadError, match="<workload>:1: a chat line needs a model with a chat "
                                            "template"):
        WorkloadRunner(demo, parse_workload(jsonl({"chat": True, "prompt": "x"})))
