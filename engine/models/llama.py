"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Gemma 2/3) over packed tokens.

Tokens of all sequences in a step are packed into one ``[T]`` batch (no padding); attention is
the only place sequences are told apart (see ``AttentionContext``). Module and parameter names
follow the HF checkpoints, so a safetensors state dict loads directly.

Inside the decoder, submodules are called through ``.forward``: ``nn.Module.__call__`` (the
hook machinery, unused here) costs over a microsecond, some 400 times per decode step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvscope.engine.models.attention import Attention, AttentionContext
from kvscope.engine.models.config import ModelConfig
from kvscope.engine.models.rotary import apply_rope, rope_cos_sin, rope_inv_freq
from kvscope.kernels import cpu


def _decode_sized(x: torch.Tensor) -> bool:
    """A few token rows on the CPU: kvscope's C kernels (``kernels/cpu.py``) instead of chains
    of small torch ops. Longer prefills stay on torch (multi-threaded, vectorised)."""
    return x.device.type == "cpu" and x.shape[0] <= cpu.MAX_ROWS


class Linear(nn.Linear):
    """nn.Linear without random init: weights always come from a checkpoint, and skipping the
    init keeps meta-device construction fast. A few float32 rows on the CPU (decode steps) go
    to kvscope's streaming kernel, about twice as fast there as torch's (``kernels/cpu.py``).
    With ``prepack`` set (``EngineConfig.prepack_cpu_weights``), longer float32 inputs on the
    CPU (prefill) go to oneDNN with a reordered copy of the weight, made on first use."""

    prepack = False  # the runner sets it per module

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            if (out := cpu.linear(x, self.weight, self.bias)) is not None:
                return out
            if self.prepack and (out := cpu.packed_linear(self, x)) is not None:
                return out
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    """Llama's norm; with ``offset`` Gemma's: ``x_normed * (1 + w)``, all in float32."""

    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            w = 1.0 + self.weight.float()
            if _decode_sized(x) and (out := cpu.rms_norm(x, w, self.eps)) is not None:
                return out
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * w).to(x.dtype)
        # Normalise in float32, cast back before the weight (as HF does).
        if _decode_sized(x) and (out := cpu.rms_norm(x, self.weight, self.eps)) is not None:
            return out
        if x.dtype == torch.float32:  # no casts: each op counts in a CPU decode step
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.q_proj = Linear(cfg.hidden_size, h * d, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, kvh * d, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, kvh * d, bias=cfg.qkv_bias)
        self.o_proj = Linear(h * d, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.norm_offset)
        else:
            self.q_norm = self.k_norm = None
        scalar = cfg.query_pre_attn_scalar
        self.attn = Attention(layer_idx, h, kvh, d, cfg.layer_windows[layer_idx],
                              scale=None if scalar is None else scalar ** -0.5,
                              softcap=cfg.attn_softcap)

    def forward(self, x, cos, sin, ctx: AttentionContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj.forward(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj.forward(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj.forward(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        fast = _decode_sized(x)  # then rotate in place, one call each
        q = q if fast and cpu.rope_(q, cos, sin) else apply_rope(q, cos, sin)
        k = k if fast and cpu.rope_(k, cos, sin) else apply_rope(k, cos, sin)
        o = self.attn.forward(q, k, v, ctx)
        return self.o_proj.forward(o.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.geglu = cfg.hidden_act == "gelu_pytorch_tanh"  # Gemma; else SiLU (SwiGLU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj.forward(x), self.up_proj.forward(x)
        if self.geglu:
            h = F.gelu(gate, approximate="tanh") * up
        elif not _decode_sized(x) or (h := cpu.silu_mul(gate, up)) is None:
            h = F.silu(gate) * up
        return self.down_proj.forward(h)


class LlamaDecoderLayer(nn.Module):
    """Llama's layer; with ``sandwich_norms`` Gemma's, whose post_attention_layernorm normalises
    the attention output (not the MLP input) and whose MLP has a norm before and after."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg)
        self.local_rope = layer_idx in cfg.local_rope_layers
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)  # noqa: E731
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        else:
            self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None

    def forward(self, x, cos, sin, ctx: AttentionContext) -> torch.Tensor:
        a = self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, ctx)
        if self.pre_feedforward_layernorm is None:
            x = x + a
            return x + self.mlp.forward(self.post_attention_layernorm.forward(x))
        x = x + self.post_attention_layernorm.forward(a)
        h = self.mlp.forward(self.pre_feedforward_layernorm.forward(x))
        return x + self.post_feedforward_layernorm.forward(h)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)


class LlamaForCausalLM(nn.Module):
    """One class for every supported architecture; differences are flags in ``ModelConfig``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Plain attributes, not buffers: not in the state dict, and survive meta-device init.
        self.inv_freq = rope_inv_freq(cfg)
        self.local_inv_freq = rope_inv_freq(cfg, local=True) if cfg.local_rope_layers else None

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        """``input_ids``/``positions`` ``[T]`` -> final hidden states ``[T, hidden]``."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        x = self.model.embed_tokens(input_ids)
        if self.config.scaled_embeddings:  # sqrt(hidden) in float32, then in x's dtype (HF's)
            x = x * torch.tensor(self.config.hidden_size ** 0.5).to(x.dtype)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        if not self._decode_in_c(x, cos, sin, ctx):
            local = cos, sin
            if self.local_inv_freq is not None:
                self.local_inv_freq = self.local_inv_freq.to(positions.device)
                local = rope_cos_sin(self.local_inv_freq, positions, x.dtype)
            for layer in self.model.layers:
                x = layer.forward(x, *(local if layer.local_rope else (cos, sin)), ctx)
        return self.model.norm(x)

    def _decode_in_c(self, x, cos, sin, ctx: AttentionContext) -> bool:
        """A float32 CPU decode step with the "cpu" kernels: every layer in one C call
        (``cpu.DecoderWeights``), the same kernels in the same order as the layers' own
        forwards (their products too, up to ``cpu.LINEAR_MAX_ROWS`` rows), without their ~400
        Python-level calls. False (nothing done) otherwise, and for Gemma's layers
        (``ModelConfig.plain_layers``: the C step has none of their quirks)."""
        if (not self.config.plain_layers or x.dtype != torch.float32 or not _decode_sized(x)
                or not ctx.is_decode or ctx.kv_cache is None or ctx.kv_amax is not None
                or ctx.kernels is None or ctx.kernels.name != "cpu" or ctx.more_groups):
            return False
        weights = self.__dict__.get("_c_weights")
        if weights is None or not weights.current():
            weights = self.__dict__["_c_weights"] = self._decoder_weights()
        return weights.run(x, cos, sin, ctx.kv_cache, ctx.slot_mapping, ctx.block_tables,
                           ctx.context_lens)

    def _decoder_weights(self) -> cpu.DecoderWeights:
        cfg, layers = self.config, []
        norms = [m for m in self.modules() if isinstance(m, RMSNorm)]
        for layer in self.model.layers:
            a, f = layer.self_attn, layer.mlp
            layers.append({
                "ln1": layer.input_layernorm.weight, "wq": a.q_proj.weight, "bq": a.q_proj.bias,
                "wk": a.k_proj.weight, "bk": a.k_proj.bias, "wv": a.v_proj.weight,
                "bv": a.v_proj.bias, "q_norm": a.q_norm.weight if a.q_norm else None,
                "k_norm": a.k_norm.weight if a.k_norm else None, "wo": a.o_proj.weight,
                "bo": a.o_proj.bias, "ln2": layer.post_attention_layernorm.weight,
                "wg": f.gate_proj.weight, "bg": f.gate_proj.bias, "wu": f.up_proj.weight,
                "bu": f.up_proj.bias, "wd": f.down_proj.weight, "bd": f.down_proj.bias})
        weights = cpu.DecoderWeights(
            layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.rms_norm_eps, cfg.head_dim ** -0.5,
            windows=[layer.self_attn.attn.window for layer in self.model.layers])
        # One eps for every norm (the C call takes one): always so from a config, but a
        # caller may have changed a module's.
        weights.usable &= all(n.eps == cfg.rms_norm_eps for n in norms)
        return weights

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if (cap := self.config.final_softcap) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
