"""When a per-head fp8 scale matters and when it does not. e4m3 is a float format: a scale only
moves its range (normal numbers keep 3 mantissa bits at any scale), so a head's own scale helps
only where one scale for all heads pushes a small head into the subnormals (below 2^-6) or a
large one past 448. SmolLM2's heads differ by 1.1-1.8x in |K| and |V| maxima, so there the two
give the same error up to rounding (the kv-formats experiment's fp8 rows); heads 2^16 apart do
not."""

from __future__ import annotations

import torch

from kvscope.engine.model_runner import FP8_HEADROOM
from kvscope.kernels.reference import FP8_DTYPE, FP8_MAX, dequantize, quantize


def roundtrip_error(x: torch.Tensor, scale) -> torch.Tensor:
    """Relative RMS error per head of x [tokens, heads, d] stored as e4m3 with this scale."""
    back = dequantize(quantize(x, FP8_DTYPE, scale), scale)
    return (back - x).norm(dim=(0, 2)) / x.norm(dim=(0, 2))


def calibrated(amax: torch.Tensor) -> torch.Tensor:
    return amax * FP8_HEADROOM / FP8_MAX  # the engine's calibration (model_runner)


def test_a_head_far_below_the_others_keeps_its_precision_only_with_its_own_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, 32, generator=g)
    x[:, 1] *= 2.0**-16  # head 1 65,536 times smaller than head 0
    amax = x.abs().amax(dim=(0, 2))
    per_tensor = roundtrip_error(x, float(calibrated(amax.max())))
    per_head = roundtrip_error(x, calibrated(amax)[:, None])
    assert per_head[0] == per_tensor[0]  # the large head: the same scale either way
    # the small head: subnormal under the shared scale (error ~ 50 %), normal under its own
    # (3 mantissa bits: at most 2^-4 relative per value)
    assert per_tensor[1] > 0.3 and per_head[1] < 0.04


def test_heads_of_similar_size_get_the_same_error_either_way():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 3, 64, generator=g) * torch.tensor([1.0, 1.5, 1.8])[None, :, None]
    amax = x.abs().amax(dim=(0, 2))
    per_tensor = roundtrip_error(x, float(calibrated(amax.max())))
    per_head = roundtrip_error(x, calibrated(amax)[:, None])
    assert torch.allclose(per_head, per_tensor, rtol=0.05)
