"""A block is a cache hit only once its KV is written (issue 11, section 1).

- A request admitted in the step in which a running request's decode fills a block hits that
  block; one packed forward pass per step writes every layer's new KV before any token attends,
  so the hit reads the real KV: warm == cold == transformers.
- A forward pass that fails withdraws the hashes its step registered: a later request with the
  same prefix computes it again and gets a fresh engine's tokens.
- One request that makes the forward pass fail fails alone; one whose admission raises is
  rejected alone and the queue moves on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_engine import BS, check_pool, hf_greedy, kv_of, make, prompt

from kvscope.engine import Engine, EngineConfig, SamplingParams
from kvscope.engine import events as ev
from kvscope.engine.stream import StepQueue

DEMO = Path(__file__).resolve().parents[2] / "resources" / "demo"
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def same_step_hit(engine: Engine, a_prompt: list[int], tail: list[int]):
    """A prefills and samples its first token; in the next step A's decode fills the block that
    ends with that token while B (A's prompt + A's output so far + `tail`) is admitted and hits
    it. Returns B's prompt, B's output and the KV B read in that step."""
    bs = engine.config.block_size
    assert (len(a_prompt) + 1) % bs == 0, "A's first output token must complete a block"
    a = engine.add_request(a_prompt, PARAMS)
    (first,) = engine.step()
    assert first.request_id == a and len(first.token_ids) == 1
    b_prompt = a_prompt + first.token_ids + tail
    b = engine.add_request(b_prompt, PARAMS)
    engine.step()
    read = kv_of(engine, b).clone()
    while engine.has_unfinished():
        engine.step()
    return b_prompt, engine._output(engine.requests[b]), read


def test_a_hit_in_the_step_that_writes_the_block_reads_the_written_kv(tiny_llama):
    _, hf = tiny_llama
    a_prompt = prompt(4 * BS - 1, seed=200)
    engine = make(tiny_llama)
    b_prompt, warm, read = same_step_hit(engine, a_prompt, prompt(3, seed=201))
    assert warm.num_cached_tokens == 4 * BS  # the block A's decode completed was hit
    fresh = make(tiny_llama)
    rid = fresh.add_request(b_prompt, PARAMS)
    fresh.step()  # the whole prompt in one prefill
    torch.testing.assert_close(read, kv_of(fresh, rid), rtol=0, atol=1e-5)
    while fresh.has_unfinished():
        fresh.step()
    cold = fresh._output(fresh.requests[rid])
    assert cold.num_cached_tokens == 0
    assert warm.token_ids == cold.token_ids == hf_greedy(hf, b_prompt, 12)
    check_pool(engine)


def test_the_same_step_hit_on_the_demo_model_and_a_later_reuse_are_right():
    from transformers import AutoModelForCausalLM

    cfg = EngineConfig(block_size=16, num_blocks=64)
    engine = Engine.from_pretrained(str(DEMO), cfg)
    ids = engine.tokenizer.encode("The list type in Python is a mutable sequence; the tuple "
                                  "is not, and a dict maps keys to values in")
    a_prompt = (ids * 3)[:47]
    b_prompt, warm, _ = same_step_hit(engine, a_prompt, ids[:5])
    assert warm.num_cached_tokens == 48
    fresh = Engine.from_pretrained(str(DEMO), cfg)
    cold = fresh.generate([b_prompt], PARAMS)[0]
    hf = AutoModelForCausalLM.from_pretrained(str(DEMO), dtype=torch.float32).eval()
    x = torch.tensor([b_prompt])
    with torch.no_grad():  # an explicit mask: the prompt repeats token 0, a pad id to generate
        want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12,
                           min_new_tokens=12, do_sample=False,
                           pad_token_id=engine.tokenizer.pad_token_id)[0, len(b_prompt):]
    assert warm.token_ids == cold.token_ids == want.tolist()
    # C reuses B's blocks (written from the hit): right too.
    c_prompt = b_prompt + warm.token_ids[:8]
    c_warm = engine.generate([c_prompt], PARAMS)[0]
    assert c_warm.num_cached_tokens >= 48
    assert c_warm.token_ids == Engine.from_pretrained(str(DEMO), cfg).generate(
        [c_prompt], PARAMS)[0].token_ids


def test_a_failed_step_does_not_poison_the_cache(tiny_llama, monkeypatch):
    engine = make(tiny_llama)
    shared = prompt(5 * BS, seed=210)
    real_run = engine.runner.run

    def broken(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(engine.runner, "run", broken)
    a = engine.add_request(shared + [7], PARAMS)
    engine.step()
    assert engine.requests[a].finish_reason == "error"
    monkeypatch.setattr(engine.runner, "run", real_run)
    assert engine.snapshot().num_cached_blocks == 0  # nothing of the failed step stays cached
    b_prompt = shared + prompt(3, seed=211)
    b = engine.generate([b_prompt], PARAMS)[0]
    assert b.num_cached_tokens == 0
    assert b.token_ids == make(tiny_llama).generate([b_prompt], PARAMS)[0].token_ids
    check_pool(engine)


def test_the_request_that_breaks_the_forward_pass_fails_alone(tiny_llama, monkeypatch):
    engine = make(tiny_llama)
    poison = 5  # a forward pass that computes this token id raises (a stand-in for a bad kernel
    #             input only one request has)
    real_run = engine.runner.run

    def fragile(chunks, copies=()):
        if any(poison in c.token_ids for c in chunks):
            raise RuntimeError("simulated failure on a bad input")
        return real_run(chunks, copies)

    monkeypatch.setattr(engine.runner, "run", fragile)
    good = [prompt(9, seed=220 + i) for i in range(3)]
    good = [[t for t in p if t != poison] for p in good]
    bad = [poison] * 6
    ids = [engine.add_request(p, PARAMS) for p in (good[0], bad, good[1], good[2])]
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    assert outs[ids[1]].finish_reason == "error" and "bad input" in outs[ids[1]].error
    fresh = make(tiny_llama).generate(good, PARAMS)
    assert [outs[r].token_ids for r in (ids[0], ids[2], ids[3])] == [o.token_ids for o in fresh]
    check_pool(engine)


def test_a_request_that_hit_a_failed_requests_block_is_recomputed(tiny_llama, monkeypatch):
    """A's decode completes a block that B hits in the same step, and A's forward pass fails:
    the block's hash is withdrawn and B, which would read unwritten KV, is preempted and
    recomputed; its tokens equal a fresh engine's."""
    engine = make(tiny_llama)
    a_prompt = prompt(4 * BS - 1, seed=230)
    a = engine.add_request(a_prompt, PARAMS)
    (first,) = engine.step()
    real_run = engine.runner.run
    doomed = a_prompt + first.token_ids  # A's chunk this step computes its last token

    def fragile(chunks, copies=()):
        if any(c.block_table == engine.manager.block_table(a) and len(chunks) >= 1
               and c.start_pos == len(doomed) - 1 for c in chunks):
            raise RuntimeError("simulated failure in A's decode")
        return real_run(chunks, copies)

    monkeypatch.setattr(engine.runner, "run", fragile)
    b_prompt = doomed + prompt(3, seed=231)
    b = engine.add_request(b_prompt, PARAMS)
    tap = StepQueue()
    engine.subscribe(tap)
    engine.step()
    assert engine.requests[a].finish_reason == "error"
    kinds = [(e.kind, e.request_id) for u in tap.drain() for e in u.events]
    assert (ev.UNCACHED, a) in kinds and (ev.PREEMPTED, b) in kinds
    monkeypatch.setattr(engine.runner, "run", real_run)
    while engine.has_unfinished():
        engine.step()
    out = engine._output(engine.requests[b])
    assert out.token_ids == make(tiny_llama).generate([b_prompt], PARAMS)[0].token_ids
    check_pool(engine)


def test_an_admission_that_raises_rejects_that_request_and_the_queue_moves_on(tiny_llama,
                                                                               monkeypatch):
    engine = make(tiny_llama)
    real_admit = engine.manager.admit
    ids = [engine.add_request(prompt(10, seed=240 + i), PARAMS) for i in range(3)]

    def admit(request_id, *args, **kwargs):
        if request_id == ids[0]:
            raise RuntimeError("simulated admission failure")
        return real_admit(request_id, *args, **kwargs)

    monkeypatch.setattr(engine.manager, "admit", admit)
    outs = {}
    for _ in range(40):
        for o in engine.step():
            outs[o.request_id] = o
        if not engine.has_unfinished():
            break
    assert outs[ids[0]].finish_reason == "rejected"
    assert "simulated admission failure" in outs[ids[0]].error
    assert [outs[r].finish_reason for r in ids[1:]] == ["length", "length"]


@pytest.mark.parametrize("bad, why", [
    ([1, 2, 10**9], "outside the model's vocabulary"),
    ([1, -1], "outside the model's vocabulary"),
    ([1, 2**63], "outside the model's vocabulary"),
    ([1, 2.5], "must be integers"),
    ([1, "x"], "must be integers"),
])
def test_bad_token_ids_are_rejected_alone(tiny_llama, bad, why):
    engine = make(tiny_llama)
    good = engine.add_request(prompt(9, seed=250), PARAMS)
    rid = engine.add_request(bad, PARAMS)
    assert engine.requests[rid].finish_reason == "rejected"
    assert why in engine.requests[rid].error
    outs = {o.request_id: o for o in engine.generate([], PARAMS)}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    assert engine.requests[good].finish_reason == "length"


def test_a_lone_surrogate_in_the_prompt_or_salt_is_rejected_alone():
    engine = Engine.from_pretrained(str(DEMO), EngineConfig(num_blocks=64))
    a = engine.add_request("bad \ud800 text", PARAMS)
    b = engine.add_request("fine text", PARAMS, cache_salt="\udfff")
    c = engine.add_request("fine text", PARAMS, cache_salt="tenant-1")
    assert "not valid text: a lone surrogate" in engine.requests[a].error
    assert "cache salt" in engine.requests[b].error
    while engine.has_unfinished():
        engine.step()
    assert engine.requests[c].finish_reason in ("length", "eos", "stop")


def test_a_long_lived_engine_forgets_old_finished_requests(tiny_llama, monkeypatch):
    """Memory stays bounded: finished requests beyond the history retire with their generator
    and explanation; the step stream (and so a recording) still saw every one."""
    from kvscope.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "FINISHED_HISTORY", 20)
    engine = make(tiny_llama)
    tap = StepQueue()
    engine.subscribe(tap)
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.7, seed=1)
    outs = engine.generate([prompt(6, seed=300 + i) for i in range(150)], params)
    assert len(outs) == 150 and all(o.finish_reason == "length" for o in outs)
    assert len(engine.requests) <= 20
    assert len(engine._generators) == 0 and len(engine.manager.explanations) <= 20
    finished = {o.request_id for u in tap.drain() for o in u.outputs if o.finished}
    assert finished == {o.request_id for o in outs}
    assert engine.cancel(outs[0].request_id) is False  # retired: finished long ago
    with pytest.raises(KeyError):
        engine.cancel(10_000)
