"""The architectures kvscope runs: one row each. Every row is Llama-shaped (one implementation,
`LlamaForCausalLM`); what differs is data: the names a Hugging Face config.json and a GGUF file
use, whether llama.cpp's converter permuted the q/k rows, and the quirk flags the forward pass
reads from `ModelConfig`. Torch-free: the window parses config.json files with it.

A quirk flag is True, False, or the config.json key whose value sets it. `sliding_window` is
"always" (the config's `sliding_window` is used when present, on every layer),
"use_sliding_window" (only when that flag is set), "per_layer" (used when present, on the layers
`layer_types` or the family's pattern names: `layer_windows.sliding_layers`), or None. `gemma`:
Gemma 2/3's quirks (`ModelConfig`'s Gemma fields: scaled embeddings, (1 + w) norms around each
sublayer, GeGLU, query_pre_attn_scalar, soft-capping). `local_rope`: the sliding layers have a
rope of their own (Gemma 3: `rope_parameters` per layer type, or `rope_local_base_freq`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Architecture:
    hf_name: str  # config.json "architectures"
    gguf_name: str  # a GGUF file's general.architecture
    gguf_tensors: str = ""  # the gguf library's arch naming its tensors (default: gguf_name)
    permuted_qk: bool = False  # llama.cpp's converter permutes q/k rows: undo when loading
    qkv_bias: bool | str = False
    o_bias: bool | str = False
    mlp_bias: bool | str = False
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before rotary
    sliding_window: str | None = None
    gemma: bool = False
    local_rope: bool = False

    def flag(self, name: str, cfg: dict[str, Any]) -> bool:
        value = getattr(self, name)
        return bool(cfg.get(value, False)) if isinstance(value, str) else value


ARCHITECTURES = (
    Architecture("LlamaForCausalLM", "llama", permuted_qk=True, qkv_bias="attention_bias",
                 o_bias="attention_bias", mlp_bias="mlp_bias"),
    Architecture("MistralForCausalLM", "mistral", "llama", permuted_qk=True,
                 sliding_window="always"),
    # Ministral 8B: Mistral's layers, the window on the layers `layer_types` names.
    Architecture("MinistralForCausalLM", "ministral", "llama", permuted_qk=True,
                 sliding_window="per_layer"),
    Architecture("Qwen2ForCausalLM", "qwen2", qkv_bias=True,
                 sliding_window="use_sliding_window"),
    Architecture("Qwen3ForCausalLM", "qwen3", qkv_bias="attention_bias", o_bias="attention_bias",
                 qk_norm=True, sliding_window="use_sliding_window"),
    Architecture("Gemma2ForCausalLM", "gemma2", qkv_bias="attention_bias",
                 o_bias="attention_bias", sliding_window="per_layer", gemma=True),
    Architecture("Gemma3ForCausalLM", "gemma3", qkv_bias="attention_bias",
                 o_bias="attention_bias", qk_norm=True, sliding_window="per_layer", gemma=True,
                 local_rope=True),
)


def supported(kind: str = "hf_name") -> str:
    """The names a user may use, for messages: "hf_name" or "gguf_name"."""
    return ", ".join(getattr(a, kind) for a in ARCHITECTURES)


def by_hf_name(name: str) -> Architecture | None:
    return next((a for a in ARCHITECTURES if a.hf_name == name), None)


def by_gguf_name(name: str) -> Architecture | None:
    return next((a for a in ARCHITECTURES if a.gguf_name == name), None)
