"""The textbook KV-cache arithmetic, checked against the numbers the textbooks quote."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvscope.lab import capacity
from kvscope.lab.capacity import GIB, InvalidConfigError, KVShape

# config.json of meta-llama/Llama-3.1-8B-Instruct as Hugging Face ships it (no head_dim key:
# head_dim = hidden_size / num_attention_heads = 4096 / 32 = 128).
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}

# A 70B GQA model: config.json of meta-llama/Llama-3.1-70B-Instruct.
LLAMA_31_70B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 8192,
    "initializer_range": 0.02,
    "intermediate_size": 28672,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}


def test_llama_8b_is_128_kib_per_token_and_491520_tokens_in_60_gib():
    shape = KVShape.from_hf_dict(LLAMA_31_8B)
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == \
        (32, 32, 8, 128)
    assert shape.kind == "GQA"
    assert capacity.kv_bytes_per_token(shape) == 2 * 32 * 8 * 128 * 2 == 131_072 == 128 * 1024
    assert capacity.format_bytes(capacity.kv_bytes_per_token(shape)) == "128 KiB"
    assert capacity.tokens_that_fit(60 * GIB, shape) == 491_520  # "about 490,000 tokens"


def test_70b_gqa_is_327680_bytes_per_token_and_10_7_gb_per_32k_request():
    shape = KVShape.from_hf_dict(LLAMA_31_70B)
    assert capacity.kv_bytes_per_token(shape, "bfloat16") == 2 * 80 * 8 * 128 * 2 == 327_680
    per_request = capacity.bytes_per_request(shape, 32_768)
    assert per_request == 32_768 * 327_680 == 10_737_418_240  # 10.74e9 bytes = 10 GiB
    assert round(per_request / 1e9, 2) == 10.74
    assert capacity.requests_that_fit(60 * GIB, shape, 32_768) == 6
    assert capacity.requests_that_fit(60 * GIB, shape, 32_768, "fp8") == 12


def test_mha_gqa_mqa_ordering_and_fp8_halves_bytes():
    shape = KVShape.from_hf_dict(LLAMA_31_8B)
    rows = capacity.capacity_table(shape, 60 * GIB, 4096)
    assert [(r.kind, r.num_kv_heads, r.precision) for r in rows] == [
        ("MHA", 32, "16-bit"), ("MHA", 32, "fp8"), ("GQA", 8, "16-bit"), ("GQA", 8, "fp8"),
        ("MQA", 1, "16-bit"), ("MQA", 1, "fp8")]
    assert [r.is_model for r in rows] == [False, False, True, True, False, False]
    by = {(r.kind, r.precision): r for r in rows}
    for p in ("16-bit", "fp8"):
        mha, gqa, mqa = by["MHA", p], by["GQA", p], by["MQA", p]
        assert mha.bytes_per_token > gqa.bytes_per_token > mqa.bytes_per_token
        assert mha.tokens_fit < gqa.tokens_fit < mqa.tokens_fit
        assert mha.requests_fit <= gqa.requests_fit <= mqa.requests_fit
        assert mha.bytes_per_token == 4 * gqa.bytes_per_token == 32 * mqa.bytes_per_token
    for kind in ("MHA", "GQA", "MQA"):
        assert by[kind, "fp8"].bytes_per_token * 2 == by[kind, "16-bit"].bytes_per_token
        assert by[kind, "fp8"].tokens_fit == 2 * by[kind, "16-bit"].tokens_fit
    assert by["GQA", "16-bit"].bytes_per_token == 131_072
    assert by["MHA", "16-bit"].bytes_per_token == 524_288  # Llama 2 7B's 512 KiB per token
    assert capacity.kv_bytes_per_token(shape, "fp32") == 2 * 131_072


def test_an_mha_model_lists_each_layout_once():
    cfg = dict(LLAMA_31_8B, num_key_value_heads=32)
    names = [(label, own) for label, _, own in capacity.variants(KVShape.from_hf_dict(cfg))]
    assert names == [("MHA · 32 KV heads", True), ("MQA · 1 KV head", False)]


def test_head_dim_key_wins_and_kv_heads_default_to_heads():
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "head_dim": 32}
    shape = KVShape.from_hf_dict(cfg)
    assert (shape.head_dim, shape.num_kv_heads, shape.kind) == (32, 4, "MHA")


def test_nested_text_config_is_read():
    cfg = {"architectures": ["Mistral3ForConditionalGeneration"], "torch_dtype": "bfloat16",
           "text_config": {"num_hidden_layers": 40, "num_attention_heads": 32,
                           "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 5120}}
    assert capacity.kv_bytes_per_token(KVShape.from_hf_dict(cfg)) == 2 * 40 * 8 * 128 * 2


def test_agrees_with_the_engines_model_config():
    from kvscope.engine.models.config import ModelConfig

    for cfg in (LLAMA_31_8B, LLAMA_31_70B):
        assert KVShape.from_any(ModelConfig.from_hf_dict(cfg)) == KVShape.from_hf_dict(cfg)


@pytest.mark.parametrize(("cfg", "message"), [
    ([1, 2], "JSON object"),
    ({"hidden_size": 4096}, "lacks num_hidden_layers, num_attention_heads"),
    (dict(LLAMA_31_8B, num_hidden_layers=0), "num_hidden_layers must be a positive integer"),
    (dict(LLAMA_31_8B, num_key_value_heads="8"), "num_key_value_heads must be a positive"),
    (dict(LLAMA_31_8B, num_key_value_heads=64), "exceeds num_attention_heads"),
    (dict(LLAMA_31_8B, hidden_size=4100), "not a multiple"),
])
def test_invalid_configs_say_why(cfg, message):
    with pytest.raises(InvalidConfigError, match=message):
        KVShape.from_hf_dict(cfg)


def test_load_config_file(tmp_path):
    good = tmp_path / "config.json"
    good.write_text(json.dumps(LLAMA_31_70B))
    assert capacity.load_config_file(good) == LLAMA_31_70B
    bad = tmp_path / "bad.json"
    bad.write_text('{"num_hidden_layers": 32,,}')
    with pytest.raises(InvalidConfigError, match="not valid JSON.*line 1"):
        capacity.load_config_file(bad)
    with pytest.raises(InvalidConfigError, match="cannot read"):
        capacity.load_config_file(tmp_path / "missing.json")


def test_mla_and_sliding_window_are_noted():
    mla = KVShape.from_hf_dict(dict(LLAMA_31_8B, kv_lora_rank=512))
    assert "latent" in mla.notes[0]
    assert KVShape.from_hf_dict(dict(LLAMA_31_8B, sliding_window=4096)).notes
    assert not KVShape.from_hf_dict(dict(LLAMA_31_8B, sliding_window=4096,
                                         use_sliding_window=False)).notes


def test_presets_match_the_shipped_configs():
    for preset, cfg in zip(capacity.PRESETS.values(), (LLAMA_31_8B, LLAMA_31_70B), strict=True):
        assert KVShape.from_hf_dict(preset) == KVShape.from_hf_dict(cfg)


def test_capacity_module_is_torch_and_qt_free():
    code = ("import sys, kvscope.lab.capacity; "
            "print(sorted(m for m in ('torch', 'PySide6', 'pyqtgraph') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
