"""Model implementations: one Llama-shaped class for every row of `architectures.ARCHITECTURES`
(quirks are `ModelConfig` flags)."""

from __future__ import annotations

from torch import nn

from kvscope.engine.models.architectures import by_hf_name, supported
from kvscope.engine.models.config import ModelConfig, UnsupportedModelError
from kvscope.engine.models.llama import LlamaForCausalLM


def get_model_class(architecture: str) -> type[nn.Module]:
    if by_hf_name(architecture) is None:
        raise UnsupportedModelError(
            f"unsupported architecture {architecture!r}; supported: {supported()}")
    return LlamaForCausalLM


__all__ = ["LlamaForCausalLM", "ModelConfig", "UnsupportedModelError", "get_model_class"]
