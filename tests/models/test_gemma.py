"""Gemma 2/3: each quirk the forward pass implements changes the logits on the tiny models, so
the equivalence tests (test_model_equivalence.py, parametrised over model_testutil.GEMMA) can
fail; the config forms transformers 4 wrote parse as those of transformers 5 do; and the
whole-decoder C step declines Gemma's layers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from model_testutil import GEMMA, LOGIT_ATOL, BlockAllocator, PagedSeq, random_prompt

from kvscope.engine.model_runner import ModelRunner
from kvscope.engine.models import ModelConfig
from kvscope.engine.models.llama import RMSNorm
from kvscope.engine.models.load import load_model

BLOCK_SIZE = 4
PROMPT = random_prompt(21, seed=1)  # three times the windows (6, 7)


def _logits(loaded, kernel_impl: str | None = None) -> torch.Tensor:
    """The last prompt token's logits through the paged runner (by default the "cpu" kernels:
    C decode attention, torch's fused prefill), then one decode step's."""
    runner = ModelRunner(loaded, num_blocks=16, block_size=BLOCK_SIZE, kernel_impl=kernel_impl)
    seq = PagedSeq(PROMPT, BlockAllocator(16, seed=2), BLOCK_SIZE, groups=len(runner.groups))
    first = runner.run([seq.chunk()])
    seq.tokens.append(int(first[0].argmax()))
    return torch.stack([first[0], runner.run([seq.chunk()])[0]])


def _off(loaded, quirk: str) -> None:
    """Take one quirk away from a loaded model."""
    model, cfg = loaded.model, loaded.config
    attns = [layer.self_attn.attn for layer in model.model.layers]
    if quirk in ("scaled_embeddings", "final_softcap"):
        model.config = dataclasses.replace(cfg, **{quirk: None if quirk == "final_softcap"
                                                   else False})
    elif quirk == "attn_softcap":
        for a in attns:
            a.softcap = None
    elif quirk == "query_pre_attn_scalar":
        for a in attns:
            a.scale = cfg.head_dim ** -0.5
    elif quirk == "norm_offset":
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.offset = False
    elif quirk == "sandwich_norms":  # Llama's order: post_attention_layernorm before the MLP
        for layer in model.model.layers:
            layer.pre_feedforward_layernorm = None
    elif quirk == "geglu":
        for layer in model.model.layers:
            layer.mlp.geglu = False
    elif quirk == "local_rope":
        for layer in model.model.layers:
            layer.local_rope = False
    else:
        raise AssertionError(quirk)


QUIRKS = {"gemma2_window": ["scaled_embeddings", "final_softcap", "attn_softcap",
                            "query_pre_attn_scalar", "norm_offset", "sandwich_norms", "geglu"],
          "gemma3_pattern": ["scaled_embeddings", "query_pre_attn_scalar", "norm_offset",
                             "sandwich_norms", "geglu", "local_rope"]}


@pytest.mark.parametrize(("spec", "quirk"), [(s, q) for s in GEMMA for q in QUIRKS[s]])
def test_each_quirk_changes_the_logits(spec, quirk, tiny_model_dir):
    folder = tiny_model_dir(spec)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([PROMPT])).logits[0, -1]
    loaded = load_model(folder)
    ours = _logits(loaded)
    assert (ours[0] - ref).abs().max().item() <= LOGIT_ATOL
    _off(loaded, quirk)
    assert (_logits(loaded) - ours).abs().max().item() > 100 * LOGIT_ATOL


@pytest.mark.parametrize("spec", GEMMA)
def test_the_torch_reference_kernels_give_transformers_logits(spec, tiny_model_dir):
    folder = tiny_model_dir(spec)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = _logits(load_model(folder), kernel_impl="torch")
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([PROMPT + [int(ours[0].argmax())]])).logits[0, -2:]
    assert (ours - ref).abs().max().item() <= LOGIT_ATOL


def test_gemma_decode_steps_take_the_per_layer_path(tiny_model_dir):
    """Gemma's layers are not plain Llama ones: the whole-decoder C step is never built."""
    loaded = load_model(tiny_model_dir("gemma2_window"))
    assert not loaded.config.plain_layers
    _logits(loaded)
    assert "_c_weights" not in loaded.model.__dict__


GEMMA3_V4 = dict(  # what transformers 4 wrote for Gemma 3: one rope_theta, the local base apart
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=320,
    hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=1, head_dim=32, sliding_window=7, sliding_window_pattern=6,
    query_pre_attn_scalar=20, rope_theta=1000000.0, rope_local_base_freq=10000.0,
    rope_scaling={"rope_type": "linear", "factor": 8.0}, hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1)


def test_transformers_4_gemma3_config_parses_as_transformers_5_writes_it():
    old = ModelConfig.from_hf_dict(GEMMA3_V4)
    new_dict = transformers.Gemma3TextConfig(**{k: v for k, v in GEMMA3_V4.items()
                                                if k != "model_type"}).to_dict()
    new = ModelConfig.from_hf_dict(new_dict)
    assert isinstance(new_dict["rope_parameters"].get("full_attention"), dict)
    assert old == new
    assert (old.rope_theta, old.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert (old.local_rope_theta, old.local_rope_scaling) == (1e4, None)
    assert old.layer_windows == (7, 7, 7, 7, 7, None) and old.local_rope_layers == (0, 1, 2, 3, 4)
