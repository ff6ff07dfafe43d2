"""Textbook KV-cache arithmetic from a Hugging Face ``config.json``: bytes per token, tokens and
requests that fit in a memory budget, for the model's attention layout and its MHA / GQA / MQA
variants, in every KV-cache format (16-bit, fp32, fp8, int8/int4 per token and head, KIVI).
Pure Python (no torch, no Qt).

    KV bytes per token   = 2 (K and V) x layers x kv_heads x head_dim x bytes per element
    bytes per request    = context tokens (prompt + output) x KV bytes per token
    tokens that fit      = floor(memory / KV bytes per token)
    requests that fit    = floor(memory / bytes per request)

Sliding-window layers hold at most W tokens of a request: bytes per request = (context x full
layers + min(context, W) x windowed layers) x bytes per token per layer. Multi-head latent
attention (DeepSeek) stores one compressed latent per token and layer, K and V together:
kv_lora_rank + qk_rope_head_dim values (576 for DeepSeek-V3) in place of 2 x kv_heads x head_dim.

Quantized formats (kvscope.engine.kv_format_spec, whose bytes the engine's pool is sized by
too) store fewer bits per value plus their scales and zero points per token: pass their
``kv_cache_dtype`` name where a dtype is asked for. KIVI also keeps a full-precision K residual
per running sequence (``format_residual_bytes``): tokens that fit leave one sequence's out,
requests that fit charge one to each request.

Paged engines round each request up to whole blocks and keep some memory for activations; these
are the upper bounds the textbook quotes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvscope.engine.kv_format_spec import QUANTIZED_FORMATS, kv_format
from kvscope.engine.layer_windows import sliding_layers, window_of

GIB = 2**30

# Bytes per stored K/V element, by the names configs and engines use.
DTYPE_BYTES = {
    "float32": 4, "fp32": 4,
    "bfloat16": 2, "float16": 2, "bf16": 2, "fp16": 2, "half": 2, "16-bit": 2,
    "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}
# The cache formats the capacity views compare: (label, kv_cache_dtype), 16-bit the baseline
# ("vs 16-bit"); an MLA latent has no KV heads to scale per head: only PLAIN_FORMATS apply.
FORMATS = (("fp32", "float32"), ("16-bit", "bfloat16"), ("fp8", "fp8"),
           *((name, name) for name in QUANTIZED_FORMATS))
PRECISIONS = (FORMATS[1], FORMATS[2])  # 16-bit and fp8: the layouts' comparison
PLAIN_FORMATS = ("float32", "bfloat16", "fp8")


class InvalidConfigError(ValueError):
    """A config.json that the arithmetic cannot use; the message is one line for the user."""


@dataclass(frozen=True)
class KVShape:
    """The attention-cache shape of a model: all the arithmetic needs."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"  # the checkpoint's dtype: the KV cache's when kv dtype is "auto"
    max_position_embeddings: int | None = None
    notes: tuple[str, ...] = ()  # where the textbook formula over- or under-states the real cache
    window: int | None = None  # the sliding window W of the windowed layers
    window_layers: int = 0  # how many layers attend within it (the others: full attention)
    latent: int | None = None  # MLA: values per token and layer (kv_lora_rank + rope dims)

    @property
    def per_layer_elements(self) -> int:
        """K/V values one token stores in one layer."""
        return self.latent or 2 * self.num_kv_heads * self.head_dim

    def formula(self, b: int) -> str:
        """KV bytes per token, spelled out."""
        if self.latent:
            return (f"{self.num_layers} layers × {self.latent} latent values "
                    f"(kv_lora_rank + qk_rope_head_dim, K and V together) × {b} B")
        return (f"2 (K and V) × {self.num_layers} layers × {self.num_kv_heads} KV heads × "
                f"{self.head_dim} head_dim × {b} B")

    def request_formula(self, context: int, dtype: str | int | None = None,
                        block_size: int = 16) -> str:
        """KV bytes per request of `context` tokens, spelled out (dtype: as layer_bytes)."""
        per_layer = layer_bytes(self, dtype, block_size)
        if not self.window_layers:
            per_token = kv_bytes_per_token(self, dtype, block_size)
            return f"(prompt + output) tokens × KV bytes per token = {context:,} × " \
                   f"{byte_figure(per_token)} B"
        full = self.num_layers - self.window_layers
        return (f"({context:,} tokens × {full} full-attention layers + min({context:,}, "
                f"{self.window:,}) × {self.window_layers} sliding-window layers) × "
                f"{byte_figure(per_layer)} B per token and layer")

    @property
    def kind(self) -> str:
        return "MLA" if self.latent else attention_kind(self.num_heads, self.num_kv_heads)

    @property
    def bytes_per_element(self) -> int:
        try:
            return element_bytes(self.dtype)
        except ValueError:  # an unusual checkpoint dtype: assume a 16-bit cache
            return 2

    def with_kv_heads(self, num_kv_heads: int) -> KVShape:
        return replace(self, num_kv_heads=num_kv_heads)

    @classmethod
    def from_hf_dict(cls, cfg: Any) -> KVShape:
        """Read the shape from a config.json dict (any architecture using these keys)."""
        if not isinstance(cfg, dict):
            raise InvalidConfigError(
                f"config.json must hold a JSON object, not {type(cfg).__name__}")
        if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
            cfg = {**cfg["text_config"], **{k: cfg[k] for k in ("dtype", "torch_dtype")
                                           if k in cfg and k not in cfg["text_config"]}}
        missing = [k for k in ("num_hidden_layers", "num_attention_heads") if k not in cfg]
        if "head_dim" not in cfg and "hidden_size" not in cfg:
            missing.append("head_dim or hidden_size")
        if missing:
            raise InvalidConfigError("config.json lacks " + ", ".join(missing)
                                     + " (not a decoder model's config?)")
        layers = _positive_int(cfg, "num_hidden_layers")
        heads = _positive_int(cfg, "num_attention_heads")
        kv_heads = _positive_int(cfg, "num_key_value_heads") \
            if cfg.get("num_key_value_heads") is not None else heads
        if kv_heads > heads:
            raise InvalidConfigError(f"num_key_value_heads ({kv_heads}) exceeds "
                                     f"num_attention_heads ({heads})")
        if cfg.get("head_dim") is not None:
            head_dim = _positive_int(cfg, "head_dim")
        else:
            hidden = _positive_int(cfg, "hidden_size")
            if hidden % heads:
                raise InvalidConfigError(f"hidden_size ({hidden}) is not a multiple of "
                                         f"num_attention_heads ({heads}) and no head_dim is given")
            head_dim = hidden // heads
        dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
        max_pos = cfg.get("max_position_embeddings")
        notes, latent = [], None
        if cfg.get("kv_lora_rank"):
            latent = _positive_int(cfg, "kv_lora_rank") + (
                _positive_int(cfg, "qk_rope_head_dim") if cfg.get("qk_rope_head_dim") else 0)
            notes.append(f"multi-head latent attention: {latent} values per token and layer "
                         f"(kv_lora_rank {cfg['kv_lora_rank']} + qk_rope_head_dim "
                         f"{cfg.get('qk_rope_head_dim', 0)}), not 2 × heads × head_dim")
        try:
            windowed = len(sliding_layers(cfg, layers))
        except ValueError as e:
            raise InvalidConfigError(f"config.json: {e}") from None
        window = _positive_int({"sliding_window": window_of(cfg)}, "sliding_window") \
            if windowed else None
        if windowed:
            notes.append(f"sliding window of {window:,} tokens in {windowed} of {layers} layers: "
                         f"they hold at most {window:,} tokens of a request")
        return cls(layers, heads, kv_heads, head_dim, dtype,
                   max_pos if isinstance(max_pos, int) and max_pos > 0 else None, tuple(notes),
                   window, windowed, latent)

    @classmethod
    def from_model_config(cls, mc) -> KVShape:
        """From our ``kvscope.engine.models.config.ModelConfig``."""
        windowed = sum(w is not None for w in mc.layer_windows)
        notes = (f"sliding window of {mc.sliding_window:,} tokens in {windowed} of "
                 f"{mc.num_layers} layers; kvscope's engine releases the blocks that leave it "
                 "(their own KV-cache group)",) if windowed else ()
        return cls(mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.torch_dtype,
                   mc.max_position_embeddings, notes, mc.sliding_window if windowed else None,
                   windowed)

    @classmethod
    def from_any(cls, config) -> KVShape:
        if isinstance(config, KVShape):
            return config
        if hasattr(config, "num_layers") and hasattr(config, "num_kv_heads"):
            return cls.from_model_config(config)
        return cls.from_hf_dict(config)

    def describe(self) -> str:
        return (f"{self.num_layers} layers · {self.num_heads} heads · {self.num_kv_heads} KV "
                f"heads ({self.kind}) · head_dim {self.head_dim} · {self.dtype}")


def _positive_int(cfg: dict, key: str) -> int:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidConfigError(f"{key} must be a positive integer, got {value!r}")
    return value


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read and check a config.json; raises InvalidConfigError with a one-line reason."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidConfigError(f"cannot read {path}: {e.strerror or e}") from e
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidConfigError(f"{path.name} is not valid JSON: {e.msg} at line {e.lineno}, "
                                 f"column {e.colno}") from e
    KVShape.from_hf_dict(cfg)  # validate now, so callers get the error at load time
    return cfg


def attention_kind(num_heads: int, num_kv_heads: int) -> str:
    if num_kv_heads == num_heads:
        return "MHA"
    return "MQA" if num_kv_heads == 1 else "GQA"


def element_bytes(dtype: str | int) -> int:
    """Bytes per K/V element: 16-bit 2, fp8 1, fp32 4; an int passes through."""
    if isinstance(dtype, int):
        return dtype
    try:
        return DTYPE_BYTES[dtype.removeprefix("torch.").lower()]
    except KeyError:
        raise ValueError(f"unknown KV dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


def format_label(cache: str) -> str:
    """The capacity views' name of a kv_cache_dtype or an engine's cache dtype ("16-bit")."""
    name = cache.removeprefix("torch.").lower()
    if name in DTYPE_BYTES:
        return {1: "fp8", 2: "16-bit", 4: "fp32"}[DTYPE_BYTES[name]]
    return name


def formats_for(shape: KVShape) -> tuple[tuple[str, str], ...]:
    """The (label, kv_cache_dtype) pairs that apply to the shape."""
    return tuple(f for f in FORMATS if not shape.latent or f[1] in PLAIN_FORMATS)


def layer_bytes(shape: KVShape, dtype: str | int | None = None, block_size: int = 16) -> float:
    """What one token costs in one layer (K and V): its values x bytes per element, or, in a
    quantized kv_cache_dtype, its packed values with their scales and zero points. dtype:
    bytes per element, a dtype name or a kv_cache_dtype; None: the checkpoint's."""
    dtype = shape.bytes_per_element if dtype is None else dtype
    if isinstance(dtype, int) or dtype.removeprefix("torch.").lower() in DTYPE_BYTES:
        return shape.per_layer_elements * element_bytes(dtype)
    if shape.latent:
        raise ValueError(f"{dtype} is per KV head: not for a latent (MLA) cache")
    return kv_format(dtype, block_size).bytes_per_token(shape.num_kv_heads, shape.head_dim,
                                                        shape.bytes_per_element)


def _whole(x: float) -> float:
    return int(x) if float(x).is_integer() else x


def byte_figure(x: float) -> str:
    """Bytes with separators; two decimals where a KIVI group shares K's scales."""
    return f"{int(x):,}" if float(x).is_integer() else f"{x:,.2f}"


def format_parts(shape: KVShape, name: str, block_size: int = 16) -> tuple[tuple[str, float], ...]:
    """A format's bytes per token and layer by part: ("data", ...) and its scales (and zero
    points) beside it (kvscope.engine.kv_format_spec's KVFormat.bytes_parts)."""
    return kv_format(name, block_size).bytes_parts(shape.num_kv_heads, shape.head_dim,
                                                   shape.bytes_per_element)


def kv_bytes_per_token(shape: KVShape, dtype: str | int | None = None,
                       block_size: int = 16) -> float:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element (MLA: layers x latent x
    bytes; a quantized format: layers x its bytes per token and layer, fractional where KIVI
    shares K's scales over a group): what one token costs while every layer holds it."""
    return _whole(shape.num_layers * layer_bytes(shape, dtype, block_size))


def format_residual_bytes(shape: KVShape, name: str, block_size: int = 16) -> int:
    """Full-precision bytes one running sequence keeps besides its blocks (KIVI's open K group
    in every layer); 0 for the other formats."""
    if name.removeprefix("torch.").lower() in DTYPE_BYTES:
        return 0
    return shape.num_layers * kv_format(name, block_size).residual_bytes(
        shape.num_kv_heads, shape.head_dim, shape.bytes_per_element)


def bytes_per_request(shape: KVShape, context_tokens: int, dtype: str | int | None = None,
                      block_size: int = 16) -> float:
    """KV bytes held by one request's blocks of context_tokens (prompt + output) tokens; its
    windowed layers hold min(context, W) of them (KIVI's residual is apart)."""
    full = shape.num_layers - shape.window_layers
    held = context_tokens * full + min(context_tokens, shape.window or 0) * shape.window_layers
    return _whole(held * layer_bytes(shape, dtype, block_size))


def tokens_that_fit(memory_bytes: float, shape: KVShape, dtype: str | int | None = None,
                    num_seqs: int = 1, block_size: int = 16) -> int:
    """Tokens that fit beside ``num_seqs`` running sequences' residuals (KIVI's; else none)."""
    residual = format_residual_bytes(shape, dtype, block_size) if isinstance(dtype, str) else 0
    left = memory_bytes - num_seqs * residual
    return max(0, int(left // kv_bytes_per_token(shape, dtype, block_size)))


def requests_that_fit(memory_bytes: float, shape: KVShape, context_tokens: int,
                      dtype: str | int | None = None, block_size: int = 16) -> int:
    """Whole requests of context_tokens each that fit in memory_bytes at once, each with its
    residual (KIVI's)."""
    if context_tokens <= 0:
        raise ValueError("context_tokens must be positive")
    residual = format_residual_bytes(shape, dtype, block_size) if isinstance(dtype, str) else 0
    return int(memory_bytes // (bytes_per_request(shape, context_tokens, dtype, block_size)
                                + residual))


@dataclass(frozen=True)
class Capacity:
    """One row of the comparison: an attention variant at one cache precision."""

    label: str  # "GQA · 8 KV heads"
    kind: str  # MHA | GQA | MQA
    num_kv_heads: int
    precision: str  # "16-bit" | "fp8" | "fp32" | a quantized kv_cache_dtype
    format: str  # its kv_cache_dtype ("bfloat16" for 16-bit)
    bytes_per_token: float  # scales and zero points included
    residual_bytes: int  # per running request, apart (KIVI's open K group)
    bytes_per_request: float
    tokens_fit: int
    requests_fit: int
    is_model: bool  # the config's own layout


def variants(shape: KVShape) -> list[tuple[str, KVShape, bool]]:
    """(label, shape, is the config's own) for MHA (kv = heads), the config, MQA (kv = 1),
    most KV heads first; a layout that coincides with the config's is listed once. An MLA model
    is its own only (its latent has no KV heads)."""
    if shape.latent:
        return [(f"MLA · {shape.latent} latent values", shape, True)]
    out = []
    for kv in sorted({shape.num_heads, shape.num_kv_heads, 1}, reverse=True):
        s = shape.with_kv_heads(kv)
        label = f"{s.kind} · {kv} KV head{'s' if kv > 1 else ''}"
        out.append((label, s, kv == shape.num_kv_heads))
    return out


def capacity_table(shape: KVShape, memory_bytes: float, context_tokens: int,
                   formats=PRECISIONS, block_size: int = 16,
                   layouts: list | None = None) -> list[Capacity]:
    """Every layout (default: every variant) x format (label, kv_cache_dtype): bytes per
    token and per request, the residual per request, tokens and requests that fit."""
    rows = []
    for label, s, own in variants(shape) if layouts is None else layouts:
        for name, fmt in formats:
            rows.append(Capacity(
                label, s.kind, s.num_kv_heads, name, fmt, kv_bytes_per_token(s, fmt, block_size),
                format_residual_bytes(s, fmt, block_size),
                bytes_per_request(s, context_tokens, fmt, block_size),
                tokens_that_fit(memory_bytes, s, fmt, block_size=block_size),
                requests_that_fit(memory_bytes, s, context_tokens, fmt, block_size), own))
    return rows


def binary_unit(n: float) -> tuple[str, int]:
    """The largest binary unit not above n: (its name, its bytes); ("B", 1) below a KiB."""
    for unit, size in (("TiB", 2**40), ("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return unit, size
    return "B", 1


def format_bytes(n: float) -> str:
    """Binary units for memory sizes: '128 KiB', '10.00 GiB'."""
    unit, size = binary_unit(n)
    value = n / size
    return f"{value:,.0f} {unit}" if value == int(value) else f"{value:,.2f} {unit}"


# Two shapes for teaching, as their config.json files state them (only the keys used here).
PRESETS: dict[str, dict[str, Any]] = {
    "Llama 3.1 8B": {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
    },
    "70B GQA (Llama 3.1 70B)": {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
    },
}
