"""Our forward pass over the paged KV matches transformers on the same saved weights."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from model_testutil import (
    GEMMA,
    LOGIT_ATOL,
    MODEL_SPECS,
    WINDOWED,
    BlockAllocator,
    PagedSeq,
    greedy_decode,
    hf_greedy,
    random_prompt,
)

from kvscope.engine.model_runner import ModelRunner
from kvscope.engine.models.load import load_model

STEPS = 64
BLOCK_SIZE = 4


@pytest.mark.parametrize("spec", list(MODEL_SPECS))
def test_prefill_and_decode_match_transformers(spec, tiny_model_dir):
    folder = tiny_model_dir(spec)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    loaded = load_model(folder)
    assert loaded.dtype == torch.float32
    assert type(hf).__name__ == loaded.config.architecture

    prompt = random_prompt(21, seed=1)
    ref_tokens, ref_logits = hf_greedy(hf, prompt, STEPS)

    num_blocks = 2 * ((len(prompt) + STEPS) // BLOCK_SIZE + 8)  # (room for two groups)
    runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=BLOCK_SIZE)
    seq = PagedSeq(prompt, BlockAllocator(num_blocks, seed=7), BLOCK_SIZE,
                   groups=len(runner.groups))
    prefill_logits = runner.run([seq.chunk()])
    tokens, logits = greedy_decode(runner, [seq], prefill_logits, STEPS)

    assert seq.table != sorted(seq.table)  # blocks really were scattered
    assert tokens[0] == ref_tokens
    assert len(logits) == STEPS
    for step, (ours, ref) in enumerate(zip(logits, ref_logits, strict=True)):
        diff = (ours[0] - ref).abs().max().item()
        assert diff <= LOGIT_ATOL, f"step {step}: max abs logit diff {diff}"


@pytest.mark.parametrize("spec", ["llama3_rope_gqa_tied", "qwen3_headdim", "qwen2_gqa_tied",
                                  *WINDOWED])
def test_naive_batch_matches_transformers(spec, tiny_model_dir):
    folder = tiny_model_dir(spec)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = ModelRunner(load_model(folder), num_blocks=4, block_size=BLOCK_SIZE)
    prompts = [random_prompt(n, seed=n) for n in (5, 40, 17)]
    ours = runner.run_naive(prompts)
    assert ours.shape == (3, hf.config.vocab_size) and ours.dtype == torch.float32
    with torch.no_grad():
        for row, prompt in zip(ours, prompts, strict=True):
            ref = hf(input_ids=torch.tensor([prompt])).logits[0, -1]
            assert (row - ref).abs().max().item() <= LOGIT_ATOL


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="triton on the CPU needs TRITON_INTERPRET=1 (tests/conftest.py)")
@pytest.mark.parametrize("spec", ["llama3_rope_gqa_tied", "qwen3_headdim", "mistral_window",
                                  "qwen2_window_layers", *GEMMA])
def test_triton_kernels_match_transformers(spec, tiny_model_dir):
    """The same forward through the triton kernels (interpreted on the CPU): chunked prefill,
    a batched step mixing prefill and decode, then batched decode."""
    pytest.importorskip("triton")
    folder = tiny_model_dir(spec)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    steps = 4
    prompts = [random_prompt(13, seed=4), random_prompt(6, seed=5)]
    refs = [hf_greedy(hf, p, steps) for p in prompts]

    runner = ModelRunner(load_model(folder), num_blocks=24, block_size=BLOCK_SIZE,
                         kernel_impl="triton")
    alloc = BlockAllocator(24, seed=3)
    a, b = (PagedSeq(p, alloc, BLOCK_SIZE, groups=len(runner.groups)) for p in prompts)
    runner.run([a.chunk(5, want_logits=False)])
    first = runner.run([a.chunk(), b.chunk()])
    tokens, logits = greedy_decode(runner, [a, b], first, steps)
    for i, (ref_tokens, ref_logits) in enumerate(refs):
        assert tokens[i] == ref_tokens
        for step, (ours, ref) in enumerate(zip(logits, ref_logits, strict=True)):
            diff = (ours[i] - ref).abs().max().item()
            assert diff <= LOGIT_ATOL, f"seq {i} step {step}: max abs logit diff {diff}"


@pytest.mark.parametrize("spec", WINDOWED)
def test_the_windowed_layers_are_the_ones_transformers_windows(spec, tiny_model_dir):
    folder = tiny_model_dir(spec)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    want = [getattr(layer.self_attn, "sliding_window", None) or hf.config.sliding_window
            if getattr(hf.config, "layer_types", None) is None
            or hf.config.layer_types[i] == "sliding_attention" else None
            for i, layer in enumerate(hf.model.layers)]
    assert list(load_model(folder).config.layer_windows) == want
    assert any(want)  # the spec has a window: the equivalence tests above exercise it
