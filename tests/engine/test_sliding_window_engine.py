"""The engine on sliding-window models (contexts several times the window): greedy tokens equal
transformers' with the cache on and off, with a prefix hit, chunked prefill and preemption; a
hybrid model (Qwen2, full and windowed layers) as well as an all-windowed one (Mistral), and
Gemma 2 (alternating layers, soft-capped) and Gemma 3 (local layers with their own rope).

The windowed layers form their own KV-cache group, whose blocks are released as they leave the
window (tests/engine/test_kv_groups.py has the rules); so a pool that preempts a full-attention
model may not preempt an all-windowed one: each model gets a pool size that does."""

from __future__ import annotations

import pytest
from model_testutil import build_tiny_model
from test_engine import (
    check_pool,
    greedy_with_cache_on_off_and_a_prefix_hit,
    hf_greedy,
    make,
    prompt,
)

from kvscope.engine import Engine, EngineConfig, SamplingParams
from kvscope.engine import explain as ex
from kvscope.engine.models.load import load_model

BS = 4
PREEMPTING_POOL = {"mistral_window": 20}  # blocks (default 32): small enough to preempt
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module", params=["mistral_window", "qwen2_window_layers", "gemma2_window",
                                        "gemma3_pattern"])
def windowed(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return folder, build_tiny_model(request.param, folder)


def test_greedy_tokens_match_transformers_with_cache_on_off_and_a_prefix_hit(windowed):
    assert 5 * windowed[1].config.sliding_window < 42  # the prompts' lengths
    greedy_with_cache_on_off_and_a_prefix_hit(windowed)


def test_chunked_prefill_and_preemption_give_transformers_tokens(windowed, request):
    _, hf = windowed
    prompts = [prompt(30 + 3 * i, seed=10 + i) for i in range(5)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    want = [hf_greedy(hf, p, 20) for p in prompts]
    # 8 tokens a step: every prompt is prefilled in chunks, most chunks start past the window.
    chunked = make(windowed, max_num_batched_tokens=8).generate(prompts, params)
    assert [o.token_ids for o in chunked] == want
    spec = request.node.callspec.params["windowed"]
    small_engine = make(windowed, num_blocks=PREEMPTING_POOL.get(spec, 32))
    small = small_engine.generate(prompts, params)
    assert sum(r.num_preempted for r in small_engine.step_records) > 0
    assert [o.token_ids for o in small] == want
    assert check_pool(small_engine).num_active_blocks == 0


def test_a_prefix_hit_the_window_group_cuts_gives_transformers_tokens(windowed, request):
    """A (40 tokens) runs in chunks, so its window blocks leave the window early; a request on
    A's first 12 tokens takes its first window blocks back; C's blocks then evict the window
    blocks A released first. B shares A's first 28 tokens: the cache reaches further than 12
    of them (full attention's blocks were released last), but the window group lacks the blocks
    it needs before that point and has them only before token 12: a hit of 12 tokens, and
    transformers' tokens."""
    _, hf = windowed
    a = prompt(40, seed=1)
    b = a[:28] + prompt(6, seed=3)
    spec = request.node.callspec.params["windowed"]
    engine = make(windowed, num_blocks=PREEMPTING_POOL.get(spec, 32), max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for p in (a, a[:12] + prompt(5, seed=9), prompt(28, seed=7)):
        engine.generate([p], params)
    out = engine.generate([b], params)[0]
    why = engine.explain_miss(out.request_id)
    assert why.reason == ex.WINDOW_CUT, why.message
    assert out.num_cached_tokens == 12 < why.reach_blocks * BS <= 28
    assert out.token_ids == hf_greedy(hf, b, 8)


def test_the_window_changes_the_tokens(windowed):
    """The same weights with the window taken away give other tokens on these prompts, so the
    tests above can fail."""
    folder, hf = windowed
    p = prompt(42, seed=2)
    loaded = load_model(folder)
    for layer in loaded.model.model.layers:
        layer.self_attn.attn.window = None
    full = Engine(loaded, EngineConfig(block_size=BS, num_blocks=64)).generate([p], PARAMS)[0]
    assert full.token_ids != hf_greedy(hf, p, 16)


@pytest.fixture(scope="module", params=["qwen2_window_layers", "gemma2_window"])
def hybrid(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return folder, build_tiny_model(request.param, folder)


@pytest.mark.parametrize("fillers, cached, host", [((), 36, 0), ((48, 48), 36, 36),
                                                   ((36,), 36, 8)],
                         ids=["device", "host", "half"])
def test_a_host_tier_on_a_hybrid_model_gives_transformers_tokens(hybrid, fillers, cached,
                                                                   host):
    """Two KV-cache groups (full attention, a 6-token window) and a host tier: A (40 tokens)
    runs and is freed on a 32-block pool; the fillers evict none, all or some of its blocks
    (both groups') to the host; B shares A's first 37 tokens and hits 36 of them from the
    device, from the host, or both. Its tokens are transformers' and the host tier's off."""
    _, hf = hybrid
    a = prompt(40, seed=1)
    b = a[:37] + prompt(6, seed=2)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outs = []
    for host_blocks in (64, 0):
        engine = make(hybrid, num_blocks=32, host_blocks=host_blocks)
        assert len(engine.runner.groups) == 2
        for p in (a, *(prompt(n, seed=3 + i) for i, n in enumerate(fillers))):
            engine.generate([p], params)
        outs.append(engine.generate([b], params)[0])
    on, off = outs
    assert (on.num_cached_tokens, on.metrics.host_cached_tokens) == (cached, host)
    assert on.token_ids == off.token_ids == hf_greedy(hf, b, 8)
    assert check_pool(engine).num_active_blocks == 0
