"""The engine end to end on a real (tiny, random) model: scheduling, preemption, cancellation,
rejection, parallel sampling, prefix reuse and equivalence with transformers' greedy decoding."""

from __future__ import annotations

import random

import pytest
import torch

from kvscope.engine import Engine, EngineConfig, SamplingParams
from kvscope.engine import events as ev
from kvscope.engine.models.load import load_model
from kvscope.engine.stream import StepQueue

BS = 4
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


def prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


def make(tiny_llama, **kw) -> Engine:
    folder, _ = tiny_llama
    cfg = dict(block_size=BS, num_blocks=256, max_num_batched_tokens=64)
    cfg.update(kw)
    return Engine(load_model(folder), EngineConfig(**cfg))


def hf_greedy(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         min_new_tokens=n, pad_token_id=0)
    return out[0, len(ids):].tolist()


def check_pool(engine: Engine):
    """Every active block belongs to a live request, and ref counts match the tables."""
    snap = engine.snapshot()
    refs = [0] * engine.num_blocks
    for table in snap.block_tables.values():
        for b in table:
            refs[b] += 1
    assert snap.ref_count.tolist() == refs
    assert set(snap.block_tables) == {r for r, q in engine.requests.items() if not q.finished
                                      and r in engine.manager.seqs}
    return snap


def test_greedy_tokens_match_transformers_with_cache_on_off_and_prefix_hit(tiny_llama):
    greedy_with_cache_on_off_and_a_prefix_hit(tiny_llama)


def greedy_with_cache_on_off_and_a_prefix_hit(model) -> None:
    """`model`: (folder, its transformers model); prompts of 42 and 46 tokens sharing 37."""
    _, hf = model
    shared = prompt(37, seed=1)
    a, b = shared + prompt(5, seed=2), shared + prompt(9, seed=3)
    want = [hf_greedy(hf, p, 16) for p in (a, b)]
    for kv_cache in (True, False):
        engine = make(model, enable_kv_cache=kv_cache)
        first = engine.generate([a], GREEDY)[0]
        second = engine.generate([b], GREEDY)[0]  # a prefix hit when the cache is on
        assert [first.token_ids, second.token_ids] == want
        assert second.num_cached_tokens == (36 if kv_cache else 0)


def test_preemption_on_a_tiny_pool_gives_the_same_greedy_tokens(tiny_llama):
    prompts = [prompt(30 + 3 * i, seed=10 + i) for i in range(5)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    big = make(tiny_llama).generate(prompts, params)
    small_engine = make(tiny_llama, num_blocks=26)  # each request alone needs <= 13 blocks
    small = small_engine.generate(prompts, params)
    assert sum(r.num_preempted for r in small_engine.step_records) > 0
    assert [o.token_ids for o in small] == [o.token_ids for o in big]
    assert all(o.finish_reason == "length" for o in small)
    assert check_pool(small_engine).num_active_blocks == 0


@pytest.mark.parametrize("phase", ["waiting", "prefill", "decode"])
def test_cancel_in_each_phase_frees_its_blocks(tiny_llama, phase):
    engine = make(tiny_llama, max_num_batched_tokens=8, max_num_seqs=2)
    other = engine.add_request(prompt(10, seed=20), GREEDY)
    rid = engine.add_request(prompt(30, seed=21), GREEDY)
    if phase == "waiting":
        engine.add_request(prompt(10, seed=22), GREEDY)
        victim = engine.add_request(prompt(10, seed=23), GREEDY)  # max_num_seqs keeps it queued
        engine.step()
        rid = victim
        assert rid not in engine.manager.seqs
    else:
        engine.step()
        engine.step()
        assert rid in engine.manager.seqs
        while phase == "decode" and not engine.requests[rid].output_token_ids:
            engine.step()
        req = engine.requests[rid]
        assert (req.num_computed_tokens < 30) == (phase == "prefill")
    assert engine.cancel(rid)
    assert not engine.cancel(rid)
    assert rid not in engine.manager.seqs
    check_pool(engine)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert engine.requests[rid].finish_reason == "cancelled"
    assert any(o.request_id == rid and o.finish_reason == "cancelled" for o in outputs)
    assert engine.requests[other].finish_reason == "length"
    assert check_pool(engine).num_active_blocks == 0


def test_a_prompt_larger_than_the_pool_is_rejected_and_the_rest_finish(tiny_llama):
    engine = make(tiny_llama, num_blocks=16)
    tap = StepQueue()
    engine.subscribe(tap)
    outs = engine.generate([prompt(20, seed=30), prompt(100, seed=31), prompt(12, seed=32)],
                           GREEDY)
    assert [o.finish_reason for o in outs] == ["length", "rejected", "length"]
    assert "needs 29 blocks" in outs[1].error and "only 16" in outs[1].error
    kinds = [e.kind for u in tap.drain() for e in u.events]
    assert ev.REJECTED in kinds


def test_parallel_sampling_shares_prompt_blocks_and_copies_on_divergence(tiny_llama):
    engine = make(tiny_llama)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=2, ignore_eos=True)
    rid = engine.add_request(prompt(10, seed=40), params)  # 2 full blocks + 2 tokens
    engine.step()  # prefill, then fork: both samples hold the same 3 blocks
    (child,) = [r for r in engine.requests.values() if r.parent_id == rid]
    snap = engine.snapshot()
    table = snap.block_tables[rid]
    assert table.tolist() == snap.block_tables[child.request_id].tolist()
    assert snap.ref_count[table].tolist() == [2, 2, 2]
    tap = StepQueue()
    engine.subscribe(tap)
    engine.step()  # both write position 10 into the shared partial block: one copy
    cows = [e for u in tap.drain() for e in u.events if e.kind == ev.COW]
    assert len(cows) == 1
    snap = engine.snapshot()
    t1, t2 = snap.block_tables[rid], snap.block_tables[child.request_id]
    assert t1[:2].tolist() == t2[:2].tolist() and t1[2] != t2[2]
    while engine.has_unfinished():
        engine.step()
    a, b = engine.requests[rid], child
    assert a.prompt_token_ids == b.prompt_token_ids and len(b.output_token_ids) == 6


def test_warm_prefix_is_served_from_the_cache(tiny_llama):
    engine = make(tiny_llama)
    system = prompt(120, seed=50)
    cold = engine.generate([system + prompt(7, seed=51)], GREEDY)[0]
    warm = engine.generate([system + prompt(7, seed=52)], GREEDY)[0]
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens == 120
    rec = [r for r in engine.step_records if r.hit_tokens]
    assert [r.hit_tokens for r in rec] == [120]
    assert warm.metrics.ttft_s is not None and warm.metrics.prompt_tokens == 127


def test_an_empty_cache_salt_is_no_salt_as_in_vllm(tiny_llama):
    engine = make(tiny_llama)
    system = prompt(120, seed=50)
    engine.generate([system + prompt(7, seed=51)], GREEDY)
    empty = engine.generate([system + prompt(7, seed=52)], GREEDY, cache_salt="")[0]
    salted = engine.generate([system + prompt(7, seed=53)], GREEDY, cache_salt="t")[0]
    assert (empty.num_cached_tokens, salted.num_cached_tokens) == (120, 0)


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(tiny_llama):
    p = prompt(12, seed=60)
    sampled = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True)
    a = make(tiny_llama).generate([p], sampled)[0].token_ids
    b = make(tiny_llama).generate([p], sampled)[0].token_ids
    assert a == b
    top1 = SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=4, ignore_eos=True)
    assert make(tiny_llama).generate([p], top1)[0].token_ids == \
        make(tiny_llama).generate([p], GREEDY)[0].token_ids[:12]


def test_step_records_and_subscribers(tiny_llama):
    engine = make(tiny_llama, warmup_steps=1)
    sub = StepQueue()
    engine.subscribe(sub)
    engine.generate([prompt(20, seed=70)], SamplingParams(max_tokens=3, ignore_eos=True))
    recs = engine.step_records
    assert recs[0].warmup and not recs[1].warmup
    assert recs[0].prefill_tokens == 20 and recs[0].decode_tokens == 0
    assert recs[1].decode_tokens == 1 and recs[1].decode_s > 0
    updates = sub.drain()
    assert [u.record.step for u in updates] == [r.step for r in recs]
    kinds = [e.kind for u in updates for e in u.events]
    assert kinds.index(ev.ARRIVED) < kinds.index(ev.ADMITTED) < kinds.index(ev.FINISHED)
    assert sum(len(u.outputs) for u in updates) == 3


def kv_of(engine: Engine, rid: int) -> torch.Tensor:
    """The KV a request reads through its block table: [layers, 2, positions, heads, dim]."""
    table = engine.manager.block_table(rid)
    n = engine.manager.num_computed_tokens(rid)
    kv = engine.runner.kv_cache[:, :, table]  # [L, 2, blocks, block_size, h, d]
    return kv.flatten(2, 3)[:, :, :n]


def test_greedy_parallel_samples_read_identical_kv(tiny_llama):
    """Every fork reads the prompt KV through its own copy of the partial block: a missed or
    wrong copy-on-write copy shows up as different KV at those positions."""
    p = prompt(10, seed=80)
    single = make(tiny_llama).generate([p], GREEDY)[0].token_ids
    engine = make(tiny_llama)
    rid = engine.add_request(p, SamplingParams(max_tokens=16, n=3, ignore_eos=True))
    for _ in range(5):
        engine.step()
    ids = [rid] + [r.request_id for r in engine.requests.values() if r.parent_id == rid]
    assert engine.snapshot().num_cow_copies == 2
    kvs = [kv_of(engine, r) for r in ids]
    assert kvs[0].shape[2] == 14
    for kv in kvs[1:]:
        torch.testing.assert_close(kv, kvs[0], rtol=0, atol=1e-5)
    while engine.has_unfinished():
        engine.step()
    assert all(engine.requests[r].output_token_ids == single for r in ids)


def test_a_failing_forward_fails_its_requests_and_the_engine_serves_on(tiny_llama, monkeypatch):
    engine = make(tiny_llama)
    a = engine.add_request(prompt(20, seed=90), GREEDY)
    real_run = engine.runner.run

    def broken(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(engine.runner, "run", broken)
    out = engine.step()  # the failure is the request's, not the engine's: step() returns
    assert [(o.request_id, o.finish_reason) for o in out] == [(a, "error")]
    assert "simulated kernel failure" in out[0].error
    assert engine.requests[a].finish_reason == "error"
    assert check_pool(engine).num_active_blocks == 0
    assert len(engine.step_records) == 1
    monkeypatch.setattr(engine.runner, "run", real_run)
    assert engine.step() == []  # reported once
    b = engine.generate([prompt(20, seed=91)], GREEDY)[0]
    assert b.finish_reason == "length" and len(b.token_ids) == 16


def test_parallel_sampling_in_the_naive_loop(tiny_llama):
    outs = make(tiny_llama, enable_kv_cache=False).generate(
        [prompt(10, seed=95)], SamplingParams(max_tokens=5, n=2, ignore_eos=True))
    single = make(tiny_llama).generate([prompt(10, seed=95)],
                                       SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert [o.token_ids for o in outs] == [single.token_ids] * 2


def test_the_event_log_is_bounded_when_nobody_drains_it():
    from kvscope.engine.events import EventLog

    log = EventLog(capacity=10)
    for i in range(25):
        log.emit("allocated", i, 1, (i,))
    assert log.num_dropped == 15
    assert [e.step for e in log.drain()] == list(range(15, 25))
    assert log.drain() == []


def test_text_prompts_need_a_tokenizer(tiny_llama):
    engine = make(tiny_llama)  # the tiny model folder has no tokenizer files
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("hello")
    assert engine.requests == {}


def test_output_text_is_decoded_incrementally_and_stop_strings_cut_it():
    """The engine decodes each token's text as it comes (not the whole output again): the text
    must still equal the whole output decoded, and a stop string that spans tokens must cut it
    at its first occurrence, as when the whole text was searched at every token."""
    engine = Engine.from_pretrained("demo", EngineConfig(num_blocks=64))
    tok = engine.tokenizer
    long = SamplingParams(max_tokens=48, ignore_eos=True)
    [out] = engine.generate(["def main(args):"], long)
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    text = out.text
    # A stop string over a token boundary, from the second half, first seen there.
    ends = [len(tok.decode(out.token_ids[:i], skip_special_tokens=True))
            for i in range(1, len(out.token_ids) + 1)]
    boundary = next(e for e in ends if e > len(text) // 2 and 3 <= e <= len(text) - 3)
    stop = text[boundary - 3:boundary + 3]
    first = text.find(stop)
    [cut] = engine.generate(["def main(args):"], SamplingParams(
        max_tokens=48, ignore_eos=True, stop=["\x00never", stop]))
    assert cut.finish_reason == "stop"
    assert cut.text == text[:first]
    assert cut.token_ids == out.token_ids[:len(cut.token_ids)]
    assert tok.decode(cut.token_ids, skip_special_tokens=True).startswith(text[:first] + stop)
