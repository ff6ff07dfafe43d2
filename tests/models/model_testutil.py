"""Test helpers for tests/models: tiny random Llama-family checkpoints built locally, and
helpers to drive the runner. (A uniquely named module, not conftest, so imports are unambiguous.)

Every model is built with transformers from a fixed seed and saved with
``save_pretrained(safe_serialization=True)``; nothing is downloaded.
"""

from __future__ import annotations

import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from kvscope.engine.model_runner import ModelRunner, SeqChunk  # noqa: E402

# Logits from our runner and from transformers (float32, same weights) agree to this.
LOGIT_ATOL = 1e-4

VOCAB = 320
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             rms_norm_eps=1e-6, initializer_range=0.1, max_position_embeddings=512,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)

# name -> (transformers config class, overrides). Covers MHA / GQA / MQA, tied and untied,
# biases, llama3 rope scaling, Qwen3's q/k norm with head_dim != hidden / heads.
MODEL_SPECS = {
    "llama_mha": (transformers.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama3_rope_gqa_tied": (transformers.LlamaConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=32))),
    "llama_bias_gqa4": (transformers.LlamaConfig, dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=8, attention_bias=True,
        mlp_bias=True)),
    "mistral_mqa": (transformers.MistralConfig, dict(
        num_attention_heads=4, num_key_value_heads=1, sliding_window=None)),
    "qwen2_gqa_tied": (transformers.Qwen2Config, dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3_headdim": (transformers.Qwen3Config, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
    # Sliding windows shorter than the prompts: every layer (Mistral), the layers from
    # max_window_layers on (Qwen2: layer 1 of 2), the layers layer_types names (Qwen3: layer 0).
    "mistral_window": (transformers.MistralConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, sliding_window=7)),
    "qwen2_window_layers": (transformers.Qwen2Config, dict(
        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=6,
        max_window_layers=1)),
    "qwen3_layer_types": (transformers.Qwen3Config, dict(
        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"])),
    # Ministral: Mistral's layers, windowed where layer_types says (layer 1 of 2).
    "ministral_layers": (transformers.MinistralConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
        layer_types=["full_attention", "sliding_attention"])),
    # Gemma 2: windowed even layers, soft-capped attention and logits (caps small enough to bend
    # these scores), query_pre_attn_scalar != head_dim. Gemma 3: q/k norms, two local layers
    # then a global one (sliding_window_pattern 3), each kind its own rope (linear on global).
    "gemma2_window": (transformers.Gemma2Config, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
        query_pre_attn_scalar=24, attn_logit_softcapping=1.0, final_logit_softcapping=2.0)),
    "gemma3_pattern": (transformers.Gemma3TextConfig, dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        sliding_window=7, sliding_window_pattern=3, query_pre_attn_scalar=20,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 100000.0}})),
}
WINDOWED = ["mistral_window", "qwen2_window_layers", "qwen3_layer_types", "ministral_layers",
            "gemma2_window", "gemma3_pattern"]
GEMMA = ["gemma2_window", "gemma3_pattern"]
ARCH_OF = {
    transformers.LlamaConfig: transformers.LlamaForCausalLM,
    transformers.MistralConfig: transformers.MistralForCausalLM,
    transformers.Qwen2Config: transformers.Qwen2ForCausalLM,
    transformers.Qwen3Config: transformers.Qwen3ForCausalLM,
    transformers.MinistralConfig: transformers.MinistralForCausalLM,
    transformers.Gemma2Config: transformers.Gemma2ForCausalLM,
    transformers.Gemma3TextConfig: transformers.Gemma3ForCausalLM,
}


def build_tiny_model(spec: str, folder, seed: int = 0, dtype=torch.float32, **changes):
    """Build, randomise (biases and norm weights too) and save one tiny model; return it.
    ``changes``: config fields over the spec's."""
    config_cls, overrides = MODEL_SPECS[spec]
    model_cls = ARCH_OF[config_cls]
    config = config_cls(**{**_BASE, **overrides, **changes}, architectures=[model_cls.__name__])
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # HF initialises biases to 0, norms to 1 (Gemma's 0): make them matter
                p.add_(torch.randn_like(p) * 0.2)
    model.to(dtype).save_pretrained(folder, safe_serialization=True)
    return model


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


class BlockAllocator:
    """Hands out physical block ids in a shuffled order (proves the paging is used)."""

    def __init__(self, num_blocks: int, seed: int = 0):
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def take(self) -> int:
        return self.free.pop()


class PagedSeq:
    """One sequence's token list and block table, growing as it is computed. `groups`: the
    runner's KV-cache groups (a table each, its own blocks; every block kept)."""

    def __init__(self, tokens, alloc: BlockAllocator, block_size: int,
                 shared_blocks: list[int] = (), num_cached: int = 0, groups: int = 1):
        self.tokens = list(tokens)
        self.alloc = alloc
        self.block_size = block_size
        self.table = list(shared_blocks)
        self.more = [[] for _ in range(groups - 1)]
        self.num_computed = num_cached

    def chunk(self, n: int | None = None, want_logits: bool = True) -> SeqChunk:
        end = len(self.tokens) if n is None else self.num_computed + n
        for table in (self.table, *self.more):
            while len(table) * self.block_size < end:
                table.append(self.alloc.take())
        c = SeqChunk(self.tokens[self.num_computed:end], self.num_computed, list(self.table),
                     want_logits, tuple(t[:] for t in self.more))
        self.num_computed = end
        return c


def greedy_decode(runner: ModelRunner, seqs: list[PagedSeq], first_logits: torch.Tensor,
                  steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Batched greedy decode of ``seqs`` (prompts already computed) for ``steps`` tokens.

    Returns the generated tokens per sequence and the logits of every step ([B, vocab]),
    starting with ``first_logits``.
    """
    logits, all_logits = first_logits, [first_logits]
    out: list[list[int]] = [[] for _ in seqs]
    for step in range(steps):
        for i, s in enumerate(seqs):
            tok = int(logits[i].argmax())
            out[i].append(tok)
            s.tokens.append(tok)
        if step == steps - 1:
            break
        logits = runner.run([s.chunk() for s in seqs])
        all_logits.append(logits)
    return out, all_logits


def hf_greedy(model, prompt: list[int], steps: int):
    """Reference: transformers prefill then ``steps - 1`` cached decode steps."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        logits = [out.logits[0, -1].float()]
        tokens = []
        for step in range(steps):
            tok = int(logits[-1].argmax())
            tokens.append(tok)
            if step == steps - 1:
                break
            out = model(input_ids=torch.tensor([[tok]]), cache=out.past_key_values,
                        use_cache=True)
            logits.append(out.logits[0, -1].float())
    return tokens, logits
