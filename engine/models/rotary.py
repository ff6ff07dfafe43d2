"""Rotary position embeddings (the "rotate half" layout used by HF Llama-family checkpoints)."""

from __future__ import annotations

import math

import torch

from kvscope.engine.models.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """float32 ``[head_dim // 2]`` inverse frequencies, including "linear"/"llama3" scaling;
    ``local``: the sliding layers' own rope (``cfg.local_rope_theta``, Gemma 3).

    Always built on the CPU (explicit device, so it also works under a meta-device context).
    """
    dim = cfg.head_dim
    theta, scaling = ((cfg.local_rope_theta, cfg.local_rope_scaling) if local
                      else (cfg.rope_theta, cfg.rope_scaling))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (theta ** exponents)
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin ``[T, 1, head_dim]`` for absolute ``positions`` ``[T]`` (computed in float32)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
