"""Gemma 3's multimodal checkpoints (`Gemma3ForConditionalGeneration`: the 4B, 12B and 27B
models) load as their text model: the nested `text_config`, with transformers' defaults where the
published file names nothing, and the `language_model.` weights; the vision tower is not read.
The engine's greedy tokens equal transformers' on text."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from model_testutil import hf_greedy, random_prompt

from kvscope.engine import Engine, EngineConfig, SamplingParams
from kvscope.engine.models.load import load_model, text_model

TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=7,
            sliding_window_pattern=3, query_pre_attn_scalar=20, max_position_embeddings=512)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              image_size=32, patch_size=16)


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3_mm")
    config = transformers.Gemma3Config(text_config=TEXT, vision_config=VISION,
                                       mm_tokens_per_image=4,
                                       architectures=["Gemma3ForConditionalGeneration"])
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norms at 0 would hide the (1 + w) offset
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


def test_greedy_tokens_equal_transformers_on_text(multimodal):
    folder, hf = multimodal
    loaded = load_model(folder)
    assert loaded.config.architecture == "Gemma3ForCausalLM"
    assert loaded.config.layer_windows == (7, 7, None)
    prompts = [random_prompt(23, seed=1), random_prompt(30, seed=2)]
    want = [hf_greedy(hf, p, 8)[0] for p in prompts]
    engine = Engine(loaded, EngineConfig(block_size=4, num_blocks=64))
    got = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in got] == want


def test_a_published_sparse_text_config_takes_transformers_defaults(multimodal):
    folder, _ = multimodal
    written = json.loads((folder / "config.json").read_text())
    full, _ = text_model(written)
    # as google/gemma-3-4b-it publishes it: only what differs from Gemma3TextConfig's defaults
    sparse = dict(written, text_config={k: written["text_config"][k] for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "sliding_window",
        "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "query_pre_attn_scalar", "max_position_embeddings")}, eos_token_id=[1, 106])
    sparse["text_config"]["num_hidden_layers"] = 7
    text, prefixes = text_model(sparse)
    assert text["eos_token_id"] == [1, 106]  # the outer config's, as the -it models set it
    assert text["layer_types"] == ["sliding_attention"] * 5 + ["full_attention",
                                                               "sliding_attention"]  # 5:1
    assert text["rope_parameters"] == full["rope_parameters"]  # 1e6 global, 1e4 local
    assert prefixes["language_model.model."] == "model."
    assert text_model({"architectures": ["LlamaForCausalLM"]}) == (
        {"architectures": ["LlamaForCausalLM"]}, None)

