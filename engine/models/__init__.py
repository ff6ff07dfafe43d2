"""Model implementations and the architecture registry."""

from __future__ import annotations

from torch import nn

from kvscope.engine.models.config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    UnsupportedModelError,
)
from kvscope.engine.models.llama import LlamaForCausalLM

# HF `architectures` name -> our implementation (all Llama-shaped; quirks are config flags).
MODEL_REGISTRY: dict[str, type[nn.Module]] = {arch: LlamaForCausalLM
                                              for arch in SUPPORTED_ARCHITECTURES}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"unsupported architecture {architecture!r}; supported: "
            + ", ".join(MODEL_REGISTRY)) from None


__all__ = [
    "MODEL_REGISTRY",
    "SUPPORTED_ARCHITECTURES",
    "LlamaForCausalLM",
    "ModelConfig",
    "UnsupportedModelError",
    "get_model_class",
]
