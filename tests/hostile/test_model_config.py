"""A model folder with a bad config.json or a weight index that points outside the folder:
one line naming the key (or shard), the file and what was expected; exit 2; the folder is left
as it was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hostile_testutil import assert_one_line_error, digest, write_jsonl
from safetensors import safe_open

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
QWEN2_WINDOW = {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
                "sliding_window": 4}
BAD_CONFIGS = {  # id -> (change to config.json (None: replace it by a list), *words)
    "a list": (None, "must hold a JSON object, got a list"),
    "layers '4'": ({"num_hidden_layers": "4"}, "num_hidden_layers must be an integer >= 1, "
                   "got '4'"),
    "layers 4.0": ({"num_hidden_layers": 4.0}, "num_hidden_layers must be an integer >= 1, "
                   "got 4.0"),
    "max positions '2048'": ({"max_position_embeddings": "2048"},
                             "max_position_embeddings must be an integer >= 1"),
    "rms_norm_eps 'x'": ({"rms_norm_eps": "x"}, "rms_norm_eps must be a number > 0, got 'x'"),
    "vocab_size -5": ({"vocab_size": -5}, "vocab_size must be an integer >= 1, got -5"),
    "eos object": ({"eos_token_id": {"id": 2}}, "eos_token_id must be a token id"),
    "eos '1'": ({"eos_token_id": "1"}, "eos_token_id must be a token id", "got '1'"),
    "eos list with text": ({"eos_token_id": [2, "3"]}, "eos_token_id must be a token id"),
    "bos true": ({"bos_token_id": True}, "bos_token_id must be a token id"),
    "heads missing": ({"num_attention_heads": None}, "lacks 'num_attention_heads'"),
    "kv heads not dividing": ({"num_key_value_heads": 3}, "not a multiple of "
                              "num_key_value_heads (3)"),
    "architectures a string": ({"architectures": "LlamaForCausalLM"},
                               "architectures must be a list of names"),
    "rope_parameters a string": ({"rope_parameters": "llama3"}, "must be an object"),
    "rope_theta 'big'": ({"rope_theta": "big", "rope_parameters": None},
                         "rope_theta must be a number > 0"),
    "linear rope without factor": ({"rope_parameters": {"rope_type": "linear"}},
                                   "lacks 'rope_parameters.factor'"),
    "llama3 rope factor '8'": ({"rope_parameters": {**LLAMA3, "factor": "8"}},
                               "rope_parameters.factor must be a number > 0, got '8'"),
    "llama3 rope low null": ({"rope_parameters": {**LLAMA3, "low_freq_factor": None}},
                             "lacks 'rope_parameters.low_freq_factor'"),
    "llama3 rope high = low": ({"rope_parameters": {**LLAMA3, "high_freq_factor": 1.0}},
                               "high_freq_factor must be greater than low_freq_factor"),
    "scaling in rope_scaling": ({"rope_parameters": None, "rope_scaling": {
        "type": "linear", "factor": -2}}, "rope_scaling.factor must be a number > 0"),
    "layer_types too short": ({**QWEN2_WINDOW, "layer_types": ["sliding_attention"]},
                              "layer_types must list 2 of sliding_attention or full_attention"),
    "layer_types unknown": ({**QWEN2_WINDOW, "layer_types": ["chunked", "full_attention"]},
                            "layer_types must list 2", "'chunked'"),
    "max_window_layers -1": ({**QWEN2_WINDOW, "max_window_layers": -1},
                             "max_window_layers must be an integer >= 0, got -1"),
    "sliding_window 0": ({**QWEN2_WINDOW, "sliding_window": 0},
                         "sliding_window must be an integer >= 1, got 0"),
    "gemma activation relu": ({"architectures": ["Gemma2ForCausalLM"], "hidden_act": "silu",
                               "hidden_activation": "relu"},
                              "unsupported hidden_activation 'relu' for Gemma",
                              "only 'gelu_pytorch_tanh'"),
    "gemma 3 text_config a list": ({"architectures": ["Gemma3ForConditionalGeneration"],
                                    "text_config": [64]},
                                   "Gemma3ForConditionalGeneration: text_config must be a JSON "
                                   "object, got [64]"),
    "gemma softcap 0": ({"architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 0},
                        "attn_logit_softcapping must be a number > 0, got 0"),
}


@pytest.fixture
def model(tmp_path, tiny_model) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    return folder


def run(kvscope, tmp_path, model):
    workload = write_jsonl(tmp_path / "w.jsonl", {"prompt_ids": [3, 4, 5], "max_tokens": 2})
    return kvscope("run", "--workload", workload, "--model", model, "--no-progress")


@pytest.mark.parametrize("case", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_a_bad_config_value_names_key_file_and_type(kvscope, tmp_path, model, case):
    change, *words = case
    cfg_file = model / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps([cfg] if change is None else {**cfg, **change}))
    before = digest(model)
    assert_one_line_error(run(kvscope, tmp_path, model), str(cfg_file), *words)
    assert digest(model) == before


def test_a_config_nested_100k_deep_is_one_line(kvscope, tmp_path, model):
    cfg_file = model / "config.json"
    cfg_file.write_text("[" * 100_000 + "]" * 100_000)
    assert_one_line_error(run(kvscope, tmp_path, model), f"cannot read {cfg_file}")


def _shard_index(model: Path, name: str) -> None:
    """Describe the model's weights as one shard called `name` in an index json."""
    with safe_open(model / "model.safetensors", framework="pt") as f:
        keys = list(f.keys())  # noqa: SIM118 (safe_open is not a dict)
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": dict.fromkeys(keys, name)}))


def test_an_index_inside_the_folder_loads(kvscope, tmp_path, model):
    _shard_index(model, "shard-1.safetensors")
    (model / "model.safetensors").rename(model / "shard-1.safetensors")
    code, out, err = run(kvscope, tmp_path, model)
    assert code == 0 and "1 finished" in out, err


@pytest.mark.parametrize("where", ["dotdot", "absolute", "symlink"])
def test_an_index_pointing_outside_the_folder_is_refused(kvscope, tmp_path, model, where):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    weights = outside / "shard-1.safetensors"
    _shard_index(model, {"dotdot": "../elsewhere/shard-1.safetensors",
                         "absolute": str(weights), "symlink": "shard-1.safetensors"}[where])
    (model / "model.safetensors").rename(weights)
    if where == "symlink":
        (model / "shard-1.safetensors").symlink_to(weights)
    before = digest(model)
    message = assert_one_line_error(run(kvscope, tmp_path, model),
                                    "model.safetensors.index.json", "outside the model folder",
                                    "(refused)")
    assert ("is a link to" in message) == (where == "symlink")
    assert digest(model) == before
