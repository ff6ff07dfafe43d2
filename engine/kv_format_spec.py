"""What each KV-cache format stores and what it costs in bytes: the names
(``EngineConfig.kv_cache_dtype``), ``KVFormat`` and ``kv_format``. Torch-free, so the window
and the capacity arithmetic read a format's bytes without torch; its tensors' dtypes import
torch where they are made. The math that writes and reads each format is
kvscope.kernels.kv_formats."""

from __future__ import annotations

import math
from dataclasses import dataclass

PLAIN_BITS = {"float32": 32, "float16": 16, "bfloat16": 16}
# The formats whose block hashes predate the quantized ones (checked against vLLM's): unchanged.
DEFAULT_FORMATS = ("auto", *PLAIN_BITS, "fp8")
QUANTIZED_FORMATS = ("fp8_per_head", "int8_per_token_head", "int4_per_token_head", "kivi4",
                     "kivi2")
FORMAT_NAMES = (*DEFAULT_FORMATS, *QUANTIZED_FORMATS)
KIVI_GROUP = 16  # K tokens per group at most; the group is gcd(block_size, KIVI_GROUP)


def _number(x: float) -> float:
    return int(x) if float(x).is_integer() else x


@dataclass(frozen=True)
class KVFormat:
    """One format at one block size."""

    name: str
    scheme: str  # "plain" | "fp8" | "fp8_per_head" | "int8" | "int4" | "kivi"
    bits: int  # bits per stored value
    group: int = 0  # kivi: K tokens per group (divides block_size)

    @property
    def is_packed(self) -> bool:
        """Scales or zero points live beside each block (and kernels need them)."""
        return self.scheme in ("int8", "int4", "kivi")

    @property
    def is_default(self) -> bool:
        return self.name in DEFAULT_FORMATS

    def packed_dim(self, head_dim: int) -> int:
        return head_dim if not self.bits or self.bits >= 8 else head_dim * self.bits // 8

    def data_dtype(self, model_dtype):
        import torch

        if self.scheme == "plain":
            return getattr(torch, self.name) if self.name in PLAIN_BITS else model_dtype
        if self.scheme in ("fp8", "fp8_per_head"):
            return torch.float8_e4m3fn
        return torch.int8 if self.scheme == "int8" else torch.uint8

    def meta_shapes(self, block_size: int, kv_heads: int, head_dim: int):
        """(shape after [slices, sides, num_blocks], sides, dtype) of each tensor beside the
        blocks: sides 2 for K and V alike, 1 for one side's own."""
        import torch

        if self.scheme in ("int8", "int4"):
            return [((block_size, kv_heads), 2, torch.float32)]
        if self.scheme == "kivi":
            return [((block_size // self.group, kv_heads, head_dim, 2), 1, torch.float16),
                    ((block_size, kv_heads, 2), 1, torch.float16)]
        return []

    def bytes_parts(self, kv_heads: int, head_dim: int, model_bytes: int = 4
                    ) -> tuple[tuple[str, float], ...]:
        """K and V bytes of one token in one layer by part: ("data", the values) and what
        lives beside them: ("scales", ...) for int8/int4 (a float32 per token, head and side;
        int4's zero point in its low bits), ("scales and zeros", ...) for KIVI (float16: K's
        per channel over G tokens, V's per token and head). Per-layer fp8 scales are
        constants, not counted."""
        if self.scheme == "plain":
            return (("data", 2 * kv_heads * head_dim * (self.bits // 8 or model_bytes)),)
        parts = [("data", 2 * kv_heads * head_dim * self.bits / 8)]
        if self.scheme in ("int8", "int4"):
            parts.append(("scales", 2 * kv_heads * 4))
        elif self.scheme == "kivi":
            parts.append(("scales and zeros", kv_heads * (head_dim * 4 / self.group + 4)))
        return tuple((part, _number(b)) for part, b in parts)

    def bytes_per_token(self, kv_heads: int, head_dim: int, model_bytes: int = 4) -> float:
        """K and V bytes of one token in one layer, scales and zero points included (the
        per-sequence KIVI residual is ``residual_bytes``)."""
        return _number(sum(b for _, b in self.bytes_parts(kv_heads, head_dim, model_bytes)))

    def residual_bytes(self, kv_heads: int, head_dim: int, model_bytes: int) -> int:
        """Full-precision K one sequence keeps per layer (KIVI's open group), else 0."""
        return (self.group - 1) * kv_heads * head_dim * model_bytes if self.scheme == "kivi" \
            else 0


ALIASES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "float8_e4m3": "fp8",
           "float8_e4m3fn": "fp8"}


def block_format(name: str, model_dtype=None) -> str:
    """A kv_cache_dtype as the blocks store it: "auto" is the model's dtype (a name or a torch
    dtype; "auto" stays where it is not known)."""
    return str(model_dtype).removeprefix("torch.") if name == "auto" and model_dtype else name


def kv_format(name: str, block_size: int = 16, group: int | None = None) -> KVFormat:
    """The format ``name`` (an ``EngineConfig.kv_cache_dtype``) at ``block_size``; ``group``:
    KIVI's K group (default gcd(block_size, KIVI_GROUP))."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in FORMAT_NAMES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; accepted: {', '.join(FORMAT_NAMES)}")
    if key in ("auto", *PLAIN_BITS):
        return KVFormat(key, "plain", PLAIN_BITS.get(key, 0))
    if key in ("fp8", "fp8_per_head"):
        return KVFormat(key, key, 8)
    if key.endswith("_per_token_head"):
        return KVFormat(key, key[:4], int(key[3]))
    group = group or math.gcd(block_size, KIVI_GROUP)
    if block_size % group:
        raise ValueError(f"the KIVI group ({group}) must divide block_size ({block_size})")
    return KVFormat(key, "kivi", int(key[4:]), group)
