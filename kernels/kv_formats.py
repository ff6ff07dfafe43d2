"""KV-cache formats: the math that writes and reads each (what a block stores and its bytes:
kvscope.engine.kv_format_spec, torch-free). Pure torch (no Qt).

``EngineConfig.kv_cache_dtype`` names one:

- ``auto``, ``float32``, ``float16``, ``bfloat16``: plain values.
- ``fp8``: e4m3, one scale per layer (1.0, or calibrated): stored ``x / scale``.
- ``fp8_per_head``: e4m3, a scale per layer and KV head (1.0, or calibrated, or given).
- ``int8_per_token_head`` (vLLM's): symmetric per token and head at write time:
  ``scale = max(|x|max / 127, 1e-6)`` (float32, beside the block),
  ``q = round_half_away(x * (1 / scale))`` clamped to [-128, 127]; read ``q * scale``.
- ``int4_per_token_head`` (vLLM's): ``x`` rotated by a randomized Hadamard transform (RHT),
  then asymmetric per token and head: ``scale = max((max - min) / 15, 1e-6)``,
  ``zp = round_half_away(-min / scale)`` in [0, 15] (kept, as vLLM does, in the low 4 mantissa
  bits of the float32 scale), ``q = round_half_away(x * (1 / scale) + zp)`` in [0, 15], two per
  byte; read ``(q - zp) * scale`` (scale without its low 4 bits), rotated back.
- ``kivi4`` / ``kivi2`` (KIVI): asymmetric with a zero point, ``scale = max((max - min) /
  (2^b - 1), 1e-5)`` and ``zero = min`` in float16, ``q = round((x - zero) / scale)`` in
  [0, 2^b - 1]; K per channel over a group of G tokens within a block, V per token and head.
  The K of a sequence's open group (fewer than G tokens) stays in full precision in a
  per-sequence residual (kvscope.engine.kivi_residual) until the group completes.

Sub-byte values are packed along head_dim, element ``j`` of each byte at bits ``b * j``
(vLLM's nibble order for 4 bits: even index low).
"""

from __future__ import annotations

import torch

# What each format stores and its bytes (torch-free), here too for the kernels' callers
from kvscope.engine.kv_format_spec import DEFAULT_FORMATS as DEFAULT_FORMATS
from kvscope.engine.kv_format_spec import FORMAT_NAMES as FORMAT_NAMES
from kvscope.engine.kv_format_spec import KIVI_GROUP as KIVI_GROUP
from kvscope.engine.kv_format_spec import QUANTIZED_FORMATS as QUANTIZED_FORMATS
from kvscope.engine.kv_format_spec import KVFormat as KVFormat
from kvscope.engine.kv_format_spec import kv_format as kv_format

INT8_MIN_SCALE, INT4_MIN_SCALE, KIVI_MIN_SCALE = 1e-6, 1e-6, 1e-5


def check_shape(fmt: KVFormat, head_dim: int) -> None:
    if fmt.bits and fmt.bits < 8 and head_dim % (8 // fmt.bits):
        raise ValueError(f"{fmt.name} packs {8 // fmt.bits} values per byte: head_dim "
                         f"{head_dim} is not a multiple of {8 // fmt.bits}")
    if fmt.scheme == "int4" and head_dim & -head_dim < 2:
        raise ValueError("int4_per_token_head rotates head_dim by a Hadamard transform: it "
                         "needs an even head_dim")


# ------------------------------------------------------------------ packing and rounding
def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes in [0, 2^bits) along the last dim -> bytes (element j of a byte at bits*j)."""
    per = 8 // bits
    q = q.to(torch.uint8).view(*q.shape[:-1], q.shape[-1] // per, per)
    out = q[..., 0].clone()
    for j in range(1, per):
        out |= q[..., j] << (bits * j)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [(packed >> (bits * j)) & mask for j in range(per)]
    return torch.stack(parts, dim=-1).flatten(-2)


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """vLLM's rounding before its integer stores truncate."""
    return torch.where(x >= 0, torch.floor(x + 0.5), torch.ceil(x - 0.5))


# ------------------------------------------------------------------ randomized Hadamard
_SIGNS: dict[int, torch.Tensor] = {}


def rht_signs(n: int) -> torch.Tensor:
    """vLLM's deterministic +-1 signs of length n (its seed and generator)."""
    if n not in _SIGNS:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(0x9E3779B9)
        _SIGNS[n] = 2.0 * torch.bernoulli(torch.full((n,), 0.5), generator=gen) - 1.0
    return _SIGNS[n]


def _hadamard(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh-Hadamard along the last (power-of-two) dim (vLLM's CPU butterfly)."""
    d, h = x.shape[-1], 1
    while h < d:
        xv = x.view(*x.shape[:-1], d // (2 * h), 2, h)
        x = torch.stack([xv[..., 0, :] + xv[..., 1, :], xv[..., 0, :] - xv[..., 1, :]],
                        dim=-2).reshape(x.shape)
        h <<= 1
    return x


def rht(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """H D x on blocks of b (the largest power of two dividing head_dim); the inverse divides
    by b (H H = b I)."""
    d = x.shape[-1]
    b = d & -d
    xb = x.float().reshape(*x.shape[:-1], d // b, b)
    signs = rht_signs(b).to(x.device)
    y = _hadamard(xb) * signs / b if inverse else _hadamard(xb * signs)
    return y.reshape(x.shape)


# ------------------------------------------------------------------ per token and head (vLLM)
def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (int8 codes [..., d], float32 scales [...])."""
    x = x.float()
    scale = (x.abs().amax(-1) / 127.0).clamp_min(INT8_MIN_SCALE)
    q = round_half_away(x * (1.0 / scale)[..., None]).clamp_(-128, 127)
    return q.to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[..., None]


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (packed uint8 [..., d/2], float32 scales with the zero point in their low
    4 bits [...]), after the RHT."""
    x = rht(x)
    lo, hi = x.amin(-1), x.amax(-1)
    scale = ((hi - lo) / 15.0).clamp_min(INT4_MIN_SCALE)
    zp = round_half_away(-lo / scale).clamp_(0, 15)
    q = round_half_away(x * (1.0 / scale)[..., None] + zp[..., None]).clamp_(0, 15)
    bits = (scale.view(torch.int32) & -16) | zp.to(torch.int32)
    return pack(q, 4), bits.view(torch.float32)


def int4_scale_zero(packed_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bits = packed_scale.view(torch.int32)
    return (bits & -16).view(torch.float32), (bits & 15).float()


def dequantize_int4(packed: torch.Tensor, packed_scale: torch.Tensor) -> torch.Tensor:
    scale, zp = int4_scale_zero(packed_scale)
    y = (unpack(packed, 4).float() - zp[..., None]) * scale[..., None]
    return rht(y, inverse=True)


# ------------------------------------------------------------------ KIVI
def _asym(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and float16 (scale, zero) stacked in a last dim of 2, reduced over `dim`."""
    qmax = (1 << bits) - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = ((hi - lo) / qmax).clamp_min(KIVI_MIN_SCALE).half()
    zero = lo.half()
    q = torch.round((x - zero.float()) / scale.float()).clamp_(0, qmax)
    return pack(q, bits), torch.stack((scale.squeeze(dim), zero.squeeze(dim)), dim=-1)


def quantize_kivi_k(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K groups x [groups, G, kv_heads, d] -> (packed [groups, G, kv_heads, d*bits/8],
    float16 (scale, zero) per channel [groups, kv_heads, d, 2])."""
    return _asym(x.float(), 1, bits)


def quantize_kivi_v(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """V x [..., d] -> (packed [..., d*bits/8], float16 (scale, zero) per token [..., 2])."""
    return _asym(x.float(), -1, bits)


def dequantize_kivi(packed: torch.Tensor, meta: torch.Tensor, bits: int) -> torch.Tensor:
    """``meta`` [..., 2] (scale, zero), broadcastable to the unpacked codes."""
    return unpack(packed, bits).float() * meta[..., 0].float() + meta[..., 1].float()
