"""What both loaders (safetensors folders, GGUF files) share: the loaded model, the error a
user can cause, the dtype rule and the weightless model whose shapes the files must match."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvscope.engine.models.config import ModelConfig

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelLoadError(Exception):
    """A model could not be found or loaded; the message is one line for the user."""


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    tokenizer: Any | None  # None when the folder has no tokenizer files
    fingerprint: str       # identifies the weights (not the dtype they were loaded in)
    path: Path
    name: str
    dtype: torch.dtype
    device: torch.device
    hf_config: dict[str, Any]  # config.json, or its equivalent built from a GGUF file


def resolve_dtype(dtype: torch.dtype | str | None, config: ModelConfig,
                  device: torch.device) -> torch.dtype:
    """Explicit dtype wins; else the checkpoint's, upcast to float32 on CPU (half matmuls are
    slow there)."""
    if dtype is not None:
        if isinstance(dtype, torch.dtype):
            return dtype
        if dtype not in _DTYPES:
            raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")
        return _DTYPES[dtype]
    chosen = _DTYPES.get(config.torch_dtype, torch.float32)
    if device.type == "cpu" and chosen in (torch.float16, torch.bfloat16):
        chosen = torch.float32
    return chosen


def names_shown(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def meta_model(model_cls: type[nn.Module], config: ModelConfig
               ) -> tuple[nn.Module, dict[str, tuple[int, ...]]]:
    """The model with no weights yet (meta device) and the tensor shapes it expects."""
    with torch.device("meta"):
        model = model_cls(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    return model, expected
