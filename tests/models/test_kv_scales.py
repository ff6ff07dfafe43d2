"""fp8 scales in the engine: given (every layer's K and V scale), or calibrated from the first
forward pass's prompts (per layer, or per layer and KV head for fp8_per_head), as a runner's own
calibration on the same prompts gives; set before anything is stored."""

from __future__ import annotations

import pytest
import torch
from model_testutil import random_prompt

from kvscope.engine import Engine, EngineConfig, SamplingParams
from kvscope.engine.model_runner import ModelRunner
from kvscope.engine.models.load import load_model

SPEC = "llama3_rope_gqa_tied"  # 2 layers, 2 KV heads, head_dim 16
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(tiny_model_dir(SPEC))


def scales(runner: ModelRunner) -> list[list[float]]:
    return [torch.as_tensor(s).flatten().tolist() for s in runner.k_scales + runner.v_scales]


@pytest.mark.parametrize("fmt", ["fp8", "fp8_per_head"])
def test_calibrate_takes_the_first_passes_prompts(loaded, fmt):
    prompts = [random_prompt(30, seed=1), random_prompt(21, seed=2)]
    e = Engine(loaded, EngineConfig(block_size=8, num_blocks=32, kv_cache_dtype=fmt,
                                    kv_scales="calibrate"))
    assert all(s == [1.0] * len(s) for s in scales(e.runner))  # not before the first pass
    e.generate(prompts, PARAMS)
    probe = ModelRunner(loaded, 4, 8, fmt)
    probe.calibrate_kv_scales(prompts)
    assert scales(e.runner) == scales(probe)
    got = scales(e.runner)
    assert all(v != 1.0 for s in got for v in s)
    if fmt == "fp8_per_head":  # one scale per KV head, and the heads differ
        assert all(len(s) == 2 and s[0] != s[1] for s in got)
    e.generate([random_prompt(40, seed=3)], PARAMS)  # later prompts leave them as they are
    assert scales(e.runner) == got


def test_a_given_scale_stores_x_over_it(loaded):
    prompt = random_prompt(16, seed=4)
    stored = {}
    for s in (1.0, 0.25):
        e = Engine(loaded, EngineConfig(block_size=8, num_blocks=8, kv_cache_dtype="fp8",
                                        kv_scales=s))
        assert scales(e.runner) == [[s]] * 4
        e.generate([prompt], SamplingParams(max_tokens=1))
        stored[s] = e.runner.kv_cache[0, :, :2].float()  # layer 0: the same input at both
    # x / 0.25 = 4x: in e4m3's normal range (2^-6 .. 448, 4x too) a power of two only moves
    # the exponent, so the stored values are exactly 4 times those stored at scale 1
    normal = (stored[1.0].abs() >= 2**-6) & (stored[1.0].abs() < 100)
    assert normal.sum() > 100
    assert torch.equal(stored[0.25][normal], 4 * stored[1.0][normal])
