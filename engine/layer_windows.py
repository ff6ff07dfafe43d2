"""Which layers of a model attend within a sliding window, read from its config.json dict as
transformers reads it. Torch-free: the engine's ModelConfig and the lab's capacity arithmetic
(which the window runs) both read it."""

from __future__ import annotations

from typing import Any

from kvscope.engine.config import shown

# A window transformers assumes when config.json names none (MinistralConfig's default).
DEFAULT_WINDOW = {"ministral": 4096}


def window_of(cfg: dict[str, Any]):
    """config.json's `sliding_window`, or the family's default when the key is absent."""
    return cfg.get("sliding_window", DEFAULT_WINDOW.get(str(cfg.get("model_type") or "")))


def sliding_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The layers that attend within `cfg["sliding_window"]`, as transformers reads a
    config.json: none without a window, or where `use_sliding_window` is false (Qwen2/Qwen3,
    where it defaults to false); every layer of a Mistral (transformers ignores its
    `layer_types`); else the layers `layer_types` calls "sliding_attention"; Gemma 3's
    `sliding_window_pattern` (every n-th layer global, default 6); Gemma 2's alternation (even
    layers local); Qwen's layers from `max_window_layers` on (default 28); else every layer.
    Raises ValueError (one line) for a bad `max_window_layers`."""
    model, every = str(cfg.get("model_type") or ""), tuple(range(num_layers))
    gated = "use_sliding_window" in cfg or model.startswith("qwen")
    if not window_of(cfg) or (gated and not cfg.get("use_sliding_window")):
        return ()
    if model == "mistral":
        return every
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == num_layers:  # (the engine checks the kinds)
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if model.startswith("gemma3"):
        pattern = cfg.get("sliding_window_pattern") or 6
        return tuple(i for i in every if (i + 1) % pattern != 0)
    if model.startswith("gemma2"):
        return every[::2]
    if gated:
        first = cfg.get("max_window_layers", 28)  # transformers' default
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise ValueError(f"max_window_layers must be an integer >= 0, got {shown(first)}")
        return every[first:]
    return every
