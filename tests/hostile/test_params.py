"""The API refuses the same bad values the command line and workload files do: SamplingParams
and EngineConfig raise ValueError naming the field; a KV pool larger than memory is refused
before it is allocated; the CLI's default thread count is the window's."""

from __future__ import annotations

import math

import pytest
import torch
from hostile_testutil import write_jsonl

from kvscope.engine import Engine, EngineConfig, SamplingParams
from kvscope.engine.models.load import load_model

BAD_SAMPLING = [
    ({"temperature": 1e-300}, "temperature"), ({"temperature": math.nan}, "temperature"),
    ({"temperature": -math.inf}, "temperature"), ({"temperature": "0.5"}, "temperature"),
    ({"top_p": math.nan}, "top_p"), ({"top_p": 0}, "top_p"), ({"seed": 2**64}, "seed"),
    ({"seed": -1}, "seed"), ({"seed": 1.5}, "seed"), ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"), ({"n": 0}, "n"), ({"n": 257}, "n"),
    ({"top_k": -1}, "top_k"), ({"stop": [""]}, "stop"), ({"stop": [3]}, "stop"),
    ({"stop": "\ud800"}, "stop"), ({"ignore_eos": 1}, "ignore_eos"),
    ({"seed": 10**5000}, "seed"), ({"n": -10**5000}, "n"), ({"seed": [1] * 10_000}, "seed"),
]


@pytest.mark.parametrize("kwargs, field", BAD_SAMPLING)
def test_sampling_params_refuse_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field} ") as info:
        SamplingParams(**kwargs)
    assert len(str(info.value)) < 120  # huge values are shown cut short


def test_sampling_params_edges_are_accepted():
    p = SamplingParams(temperature=1e-6, seed=2**64 - 1, n=256, stop="end", top_p=1)
    assert p.stop == ["end"]  # a single string is a list of one


BAD_ENGINE = [
    ({"kv_scales": "x"}, "kv_scales"),
    ({"kv_scales": float("nan")}, "kv_scales"),
    ({"kv_scales": -1.0}, "kv_scales"),
    ({"kv_scales": 2.0, "kv_cache_dtype": "int8_per_token_head"}, "kv_scales"),
    ({"block_size": 0}, "block_size"), ({"block_size": 16.0}, "block_size"),
    ({"num_blocks": True}, "num_blocks"), ({"max_num_seqs": -1}, "max_num_seqs"),
    ({"kv_cache_dtype": "int3"}, "kv_cache_dtype"), ({"dtype": "float64"}, "dtype"),
    ({"device": "tpu"}, "device"), ({"gpu_memory_fraction": math.nan}, "gpu_memory_fraction"),
    ({"gpu_memory_fraction": 1.5}, "gpu_memory_fraction"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching"),
    ({"prepack_cpu_weights": 1}, "prepack_cpu_weights"),
    ({"warmup_steps": -1}, "warmup_steps"),
]


@pytest.mark.parametrize("kwargs, field", BAD_ENGINE)
def test_engine_config_refuses_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=rf"^EngineConfig\.{field} "):
        EngineConfig(**kwargs)


def test_a_pool_larger_than_memory_is_refused_before_allocating(tiny_model, monkeypatch):
    import psutil

    loaded = load_model(tiny_model)
    zeros = []
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: zeros.append(a))
    # Twice what is available (512 bytes per token here): available memory moves between this
    # line and the engine's check, so one block over it could fit by then.
    blocks = 2 * psutil.virtual_memory().available // (16 * 512)
    with pytest.raises(ValueError, match=rf"the KV pool needs .* \({blocks} blocks x 16 tokens "
                       r"x 512 bytes per token\) but only .* of memory is available"):
        Engine(loaded, EngineConfig(num_blocks=blocks))
    assert zeros == []  # refused before the allocation


def test_the_cli_uses_all_cores_but_one_unless_told(kvscope, tmp_path, tiny_model,
                                                   monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("kvscope.app.host.server.cpu_cores", lambda: 3)
    workload = write_jsonl(tmp_path / "w.jsonl", {"prompt_ids": [3, 4], "max_tokens": 1})
    argv = ["run", "--workload", workload, "--model", tiny_model, "--no-progress"]
    assert kvscope(*argv)[0] == 0
    assert torch.get_num_threads() == 2
    assert kvscope(*argv, "--threads", "1")[0] == 0
    assert torch.get_num_threads() == 1
