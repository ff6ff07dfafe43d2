"""KV memory of sliding-window, hybrid and latent-attention models, against numbers computed by
hand here from the models' config.json keys (only the keys the arithmetic reads)."""

from __future__ import annotations

from kvscope.lab import capacity
from kvscope.lab.capacity import KVShape

# google/gemma-3-27b-it's text_config: 62 layers, every 6th one global (5 local : 1 global),
# local layers windowed to 1,024 tokens.
GEMMA3_27B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "torch_dtype": "bfloat16", "text_config": {
                  "model_type": "gemma3_text", "hidden_size": 5376, "num_hidden_layers": 62,
                  "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
                  "sliding_window": 1024, "sliding_window_pattern": 6,
                  "max_position_embeddings": 131072}}
# mistralai/Mistral-7B-v0.1: every layer windowed to 4,096 tokens.
MISTRAL_7B = {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
              "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "sliding_window": 4096, "torch_dtype": "bfloat16",
              "max_position_embeddings": 32768}
# deepseek-ai/DeepSeek-V3: multi-head latent attention, a 512-value latent + 64 rope values.
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
               "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
               "num_key_value_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
               "qk_nope_head_dim": 128, "v_head_dim": 128, "torch_dtype": "bfloat16",
               "max_position_embeddings": 163840}


def test_gemma3_holds_1024_tokens_in_its_52_local_layers():
    shape = KVShape.from_hf_dict(GEMMA3_27B)
    # global layers: 5, 11, ..., 59 -> 10 of 62; per token and layer 2 x 16 x 128 x 2 B = 8 KiB
    assert (shape.window, shape.window_layers) == (1024, 52)
    per_layer = 2 * 16 * 128 * 2
    assert capacity.kv_bytes_per_token(shape) == 62 * per_layer == 507_904
    # 32k tokens: 10 layers hold all of them, 52 layers hold 1,024
    assert capacity.bytes_per_request(shape, 32_768) == (10 * 32_768 + 52 * 1024) * per_layer \
        == 3_120_562_176
    assert capacity.bytes_per_request(shape, 800) == 800 * 62 * per_layer  # inside the window
    # against full attention in every layer (15.5 GiB): 2.9 GiB, 0.1875 of it
    assert capacity.bytes_per_request(shape, 32_768) / (32_768 * 62 * per_layer) \
        == (10 * 32 + 52) / (62 * 32)
    assert "min(32,768, 1,024) × 52 sliding-window layers" in shape.request_formula(32_768, 2)


def test_mistral_7b_holds_at_most_4096_tokens_a_request():
    shape = KVShape.from_hf_dict(MISTRAL_7B)
    assert (shape.window, shape.window_layers) == (4096, 32)
    assert capacity.kv_bytes_per_token(shape) == 2 * 32 * 8 * 128 * 2 == 131_072
    assert capacity.bytes_per_request(shape, 2048) == 2048 * 131_072
    assert capacity.bytes_per_request(shape, 8192) == capacity.bytes_per_request(shape, 4096) \
        == 4096 * 131_072 == 512 * 2**20
    assert capacity.requests_that_fit(40 * 2**30, shape, 32_768) == 80  # 40 GiB / 512 MiB


def test_deepseek_v3_stores_576_values_per_token_and_layer():
    shape = KVShape.from_hf_dict(DEEPSEEK_V3)
    assert shape.latent == 576 and shape.kind == "MLA"
    assert capacity.kv_bytes_per_token(shape) == 61 * 576 * 2 == 70_272
    # the MHA formula would say 2 x 61 x 128 x 128 x 2 B = 3,997,696 B: 56.9x more
    assert 2 * 61 * 128 * 128 * 2 / capacity.kv_bytes_per_token(shape) > 56
    assert capacity.bytes_per_request(shape, 4096) == 4096 * 70_272
    rows = capacity.capacity_table(shape, 2**30, 4096)
    assert [r.label for r in rows] == ["MLA · 576 latent values"] * 2  # 16-bit and fp8
    assert rows[1].bytes_per_token == 61 * 576
    assert "61 layers × 576 latent values" in shape.formula(2)


def test_qwen2_windows_from_max_window_layers_and_gemma2_alternates():
    qwen = dict(MISTRAL_7B, model_type="qwen2", use_sliding_window=True, max_window_layers=20)
    assert KVShape.from_hf_dict(qwen).window_layers == 12
    assert KVShape.from_hf_dict(dict(qwen, use_sliding_window=False)).window_layers == 0
    gemma2 = dict(MISTRAL_7B, model_type="gemma2", num_hidden_layers=42)
    assert KVShape.from_hf_dict(gemma2).window_layers == 21
    typed = dict(qwen, num_hidden_layers=3,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    assert KVShape.from_hf_dict(typed).window_layers == 2
    # transformers' Mistral windows every layer whatever layer_types says, as the engine does
    assert KVShape.from_hf_dict(dict(typed, model_type="mistral")).window_layers == 3


def test_the_engines_windowed_model_config_says_its_pool_releases_the_window():
    from kvscope.engine.models.config import ModelConfig

    cfg = dict(MISTRAL_7B, vocab_size=32000, intermediate_size=14336)
    shape = KVShape.from_any(ModelConfig.from_hf_dict(cfg))
    assert (shape.window, shape.window_layers) == (4096, 32)
    assert "releases the blocks that leave it" in shape.notes[0]
