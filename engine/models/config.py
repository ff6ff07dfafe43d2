"""Our own small model config, parsed from a Hugging Face ``config.json`` dict.

Only the fields our forward pass uses are kept. Architecture quirks (Qwen2's q/k/v bias,
Qwen3's per-head q/k RMSNorm, Gemma's norms, activation and soft-capping) become plain fields
here, so the model code has no ``if arch == ...`` branches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvscope.engine.config import shown
from kvscope.engine.layer_windows import DEFAULT_WINDOW
from kvscope.engine.layer_windows import sliding_layers as sliding_layers_of
from kvscope.engine.models.architectures import by_hf_name, supported

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
LAYER_KINDS = ("sliding_attention", "full_attention")  # the layer_types the engine runs


class UnsupportedModelError(ValueError):
    """config.json describes a model our forward pass cannot run (one-line message)."""


_MISSING = object()


def _field(cfg: dict[str, Any], key: str, kind: str, default: Any = _MISSING) -> Any:
    """cfg[key] checked against `kind`: "size" (an integer >= 1), "positive" (a finite number
    > 0), "token" (an integer >= 0). A missing key (or null) gives `default`."""
    value = cfg.get(key)
    if value is None:
        if default is _MISSING:
            raise UnsupportedModelError(f"config.json lacks {key!r}")
        return default
    is_int = isinstance(value, int) and not isinstance(value, bool)
    ok = {"size": is_int and value >= 1, "token": is_int and value >= 0,
          "positive": (is_int or isinstance(value, float)) and 0 < value < math.inf}[kind]
    if not ok:
        what = {"size": "an integer >= 1", "token": "a token id (an integer >= 0)",
                "positive": "a number > 0"}[kind]
        raise UnsupportedModelError(f"config.json: {key} must be {what}, got {shown(value)}")
    return value


def _eos_ids(cfg: dict[str, Any]) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    return tuple(_field({"eos_token_id": t}, "eos_token_id", "token") for t in ids)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    rope_scaling: dict[str, Any] | None = None  # extra rope parameters ("llama3", "linear")
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rotary
    sliding_window: int | None = None  # W of the sliding-window layers (None: no such layers)
    # The layers that attend within the window (None: every layer, when there is a window).
    sliding_layers: tuple[int, ...] | None = None
    torch_dtype: str = "float32"  # the checkpoint's dtype name ("bfloat16", ...)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Gemma 2/3 (Architecture.gemma), each as transformers' modeling_gemma2/3.py has it:
    hidden_act: str = "silu"  # the MLP gate's activation: "silu", or "gelu_pytorch_tanh" (GeGLU)
    scaled_embeddings: bool = False  # embeddings times sqrt(hidden_size), in their dtype
    norm_offset: bool = False  # every RMSNorm is x_normed * (1 + w), all in float32
    sandwich_norms: bool = False  # a norm after attention, and before and after the MLP
    query_pre_attn_scalar: float | None = None  # attention scale s ** -0.5 (None: head_dim)
    attn_softcap: float | None = None  # scores -> tanh(s / C) * C before the mask (Gemma 2)
    final_softcap: float | None = None  # the same on the logits
    # Gemma 3: the sliding layers' rope (None: every layer has rope_theta and rope_scaling).
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention)."""
        w, only = self.sliding_window, self.sliding_layers
        return tuple(w if only is None or i in only else None for i in range(self.num_layers))

    @property
    def rope_type(self) -> str:
        return (self.rope_scaling or {}).get("rope_type", "default")

    @property
    def local_rope_layers(self) -> tuple[int, ...]:
        """The layers rotated with the local rope (Gemma 3's sliding layers)."""
        if self.local_rope_theta is None:
            return ()
        return tuple(i for i, w in enumerate(self.layer_windows) if w is not None)

    @property
    def plain_layers(self) -> bool:
        """Llama's decoder layers, none of Gemma's quirks inside them (what the whole-decoder
        C decode step, ``cpu.DecoderWeights``, runs)."""
        return (self.hidden_act == "silu" and not self.norm_offset and not self.sandwich_norms
                and self.query_pre_attn_scalar is None and self.attn_softcap is None
                and self.local_rope_theta is None)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
            raise UnsupportedModelError(f"config.json: architectures must be a list of names, "
                                        f"got {shown(archs)}")
        arch = next((by_hf_name(a) for a in archs if by_hf_name(a)), None)
        if arch is None:
            found = ", ".join(archs) if archs else "none listed in config.json"
            raise UnsupportedModelError(
                f"unsupported architecture ({found}); supported: {supported()}")
        if not arch.gemma and (act := cfg.get("hidden_act", "silu")) != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {act!r} (only 'silu')")

        num_heads = _field(cfg, "num_attention_heads", "size")
        hidden = _field(cfg, "hidden_size", "size")
        num_kv_heads = _field(cfg, "num_key_value_heads", "size", num_heads)
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(f"config.json: num_attention_heads ({num_heads}) is not "
                                        f"a multiple of num_key_value_heads ({num_kv_heads})")
        head_dim = _field(cfg, "head_dim", "size", hidden // num_heads)
        if not head_dim:
            raise UnsupportedModelError(f"config.json: hidden_size ({hidden}) is smaller than "
                                        f"num_attention_heads ({num_heads})")
        theta, rope_scaling = _parse_rope(cfg)
        gemma = _gemma_fields(cfg, arch.local_rope) if arch.gemma else {}
        if "full_attention" in gemma:  # Gemma 3's rope per layer type
            theta, rope_scaling = gemma.pop("full_attention")

        sliding_window = None
        if arch.sliding_window in ("always", "per_layer") or (
                arch.sliding_window and cfg.get(arch.sliding_window)):
            sliding_window = _field(cfg, "sliding_window", "size",
                                    DEFAULT_WINDOW.get(str(cfg.get("model_type") or "")))
        num_layers = _field(cfg, "num_hidden_layers", "size")
        types = cfg.get("layer_types")
        if sliding_window and arch.sliding_window != "always" and types is not None and (
                not isinstance(types, list) or len(types) != num_layers
                or any(t not in LAYER_KINDS for t in types)):
            raise UnsupportedModelError(f"config.json: layer_types must list {num_layers} of "
                                        f"{' or '.join(LAYER_KINDS)}, got {shown(types)}")
        try:
            sliding_layers = sliding_layers_of(cfg, num_layers) if sliding_window else None
        except ValueError as e:
            raise UnsupportedModelError(f"config.json: {e}") from None

        return cls(
            architecture=arch.hf_name,
            vocab_size=_field(cfg, "vocab_size", "size"),
            hidden_size=hidden,
            intermediate_size=_field(cfg, "intermediate_size", "size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(_field(cfg, "rms_norm_eps", "positive", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=_field(cfg, "max_position_embeddings", "size", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=rope_scaling,
            qkv_bias=arch.flag("qkv_bias", cfg),
            o_bias=arch.flag("o_bias", cfg),
            mlp_bias=arch.flag("mlp_bias", cfg),
            qk_norm=arch.flag("qk_norm", cfg),
            sliding_window=sliding_window,
            sliding_layers=sliding_layers,
            torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            bos_token_id=_field(cfg, "bos_token_id", "token", None),
            eos_token_ids=_eos_ids(cfg),
            **gemma,
        )


GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)


def _gemma_fields(cfg: dict[str, Any], local_rope: bool) -> dict[str, Any]:
    """ModelConfig's Gemma fields from a Gemma 2/3 config.json; with ``local_rope`` (Gemma 3:
    ``rope_parameters`` per layer type, or the older ``rope_local_base_freq``) the sliding
    layers' rope, and the others' as "full_attention" -> (rope_theta, scaling) when given per
    layer type."""
    act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"  # transformers reads only this
    if act not in GEMMA_ACTIVATIONS:
        raise UnsupportedModelError(f"unsupported hidden_activation {act!r} for Gemma (only "
                                    + ", ".join(repr(a) for a in GEMMA_ACTIVATIONS) + ")")
    fields: dict[str, Any] = dict(
        hidden_act=act, scaled_embeddings=True, norm_offset=True, sandwich_norms=True,
        query_pre_attn_scalar=float(_field(cfg, "query_pre_attn_scalar", "positive", 256)),
        attn_softcap=_field(cfg, "attn_logit_softcapping", "positive", None),
        final_softcap=_field(cfg, "final_logit_softcapping", "positive", None))
    if not local_rope:
        return fields
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        fields["full_attention"] = _parse_rope({**cfg, "rope_parameters":
                                                params["full_attention"]})
        local = params.get("sliding_attention") or {}
        fields["local_rope_theta"], fields["local_rope_scaling"] = _parse_rope(
            {**cfg, "rope_parameters": local or {"rope_theta": 10000.0}})
    else:
        fields["local_rope_theta"] = float(_field(cfg, "rope_local_base_freq", "positive",
                                                  10000.0))
    return fields


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling parameters or None) from either config style.

    transformers >= 5 writes ``rope_parameters: {rope_theta, rope_type, ...}``; older
    checkpoints have a top-level ``rope_theta`` and ``rope_scaling: {type|rope_type, ...}``.
    """
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise UnsupportedModelError(f"config.json: rope_parameters / rope_scaling must be an "
                                    f"object, got {shown(params)}")
    params = dict(params)
    theta = params.pop("rope_theta", cfg.get("rope_theta"))
    theta = float(_field({"rope_theta": theta}, "rope_theta", "positive", 10000.0))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope type {rope_type!r}; supported: " + ", ".join(SUPPORTED_ROPE_TYPES))
    if params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError("partial rotary embeddings are not supported")
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        if "original_max_position_embeddings" in cfg:  # Phi-3 style, wins as in transformers
            params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings",
                          cfg.get("max_position_embeddings", 8192))
    _check_rope_scaling(params, rope_type,
                        "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling")
    return theta, {"rope_type": rope_type, **params}


def _check_rope_scaling(params: dict[str, Any], rope_type: str, where: str) -> None:
    """The numbers rotary.py divides by: present, positive, and for llama3 ordered."""
    kinds = {"factor": "positive"}
    if rope_type == "llama3":
        kinds.update(low_freq_factor="positive", high_freq_factor="positive",
                     original_max_position_embeddings="size")
    value = {k: _field({f"{where}.{k}": params.get(k)}, f"{where}.{k}", kind)
             for k, kind in kinds.items()}
    if rope_type == "llama3" and value["high_freq_factor"] <= value["low_freq_factor"]:
        raise UnsupportedModelError(f"config.json: {where}.high_freq_factor must be greater "
                                    "than low_freq_factor")
