"""Write small GGUF files with ``gguf``'s own writer, as llama.cpp's convert script lays them out.

Matrices are stored in the requested quant type: quantized by ``gguf`` where it can, otherwise
(the K-quants, which gguf-py only dequantizes) as random blocks with sane float16 scales.
Llama q/k rows are permuted the way ``convert_hf_to_gguf.py``'s ``LlamaModel.permute`` does;
Gemma norms are stored plus one, with its soft-capping and window keys, as its Gemma models do.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

# byte offsets of the float16 scales in one block of each K-quant (ggml-common.h)
_K_SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half rows -> interleaved)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def encode(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Raw GGUF data of ``w`` in ``qtype`` (K-quants: random blocks of ``w``'s shape)."""
    if qtype in _K_SCALE_OFFSETS:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n_blocks = w.shape[-1] // block_size
        raw = rng.integers(0, 256, (*w.shape[:-1], n_blocks, type_size), dtype=np.uint8)
        scales = rng.uniform(0.001, 0.02, raw.shape[:-1]).astype(np.float16)
        for off in _K_SCALE_OFFSETS[qtype]:
            raw[..., off:off + 2] = scales[..., None].view(np.uint8)
        return raw.reshape(*w.shape[:-1], n_blocks * type_size)
    if qtype == Q.F32:
        return w.astype(np.float32)
    if qtype == Q.F16:
        return w.astype(np.float16)
    return gguf.quantize(w.astype(np.float32), qtype)


def write_llama_gguf(path, cfg: dict, hf_tensors: dict[str, np.ndarray], qtype: Q,
                     seed: int = 0, arch: str = "llama") -> dict[str, np.ndarray]:
    """Write a Llama-family GGUF file; return each tensor's raw data by GGUF name (as written).

    ``cfg`` holds HF config fields; ``hf_tensors`` HF-named float32 arrays. Vectors stay F32
    (as llama.cpp stores norms); matrices are stored as ``qtype``. ``arch``: llama, qwen2, qwen3,
    gemma2, gemma3 (only llama's q/k rows are permuted, as the converter does). ``cfg``'s
    ``rope_scaling`` {"rope_type": "linear", "factor": f} is written as the file's scaling.
    """
    rng = np.random.default_rng(seed)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(model_arch, cfg["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny test llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg.get("max_position_embeddings", 512))
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(cfg["vocab_size"])
    if (cfg.get("rope_scaling") or {}).get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg["rope_scaling"]["factor"])
    gemma = arch.startswith("gemma")
    if gemma and cfg.get("sliding_window"):
        writer.add_sliding_window(cfg["sliding_window"])
    if gemma and cfg.get("attn_logit_softcapping"):
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    if gemma and cfg.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    written = {}
    for hf_name, w in hf_tensors.items():
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{name_map.get_name(base)}.{suffix}"
        if arch == "llama" and base.endswith("q_proj"):
            w = llama_cpp_permute(w, heads)
        elif arch == "llama" and base.endswith("k_proj"):
            w = llama_cpp_permute(w, kv_heads)
        elif gemma and base.endswith("norm"):  # convert_hf_to_gguf.py's Gemma norm_shift
            w = w + 1
        raw = encode(w, qtype, rng) if w.ndim == 2 else w.astype(np.float32)
        tensor_type = qtype if w.ndim == 2 else Q.F32
        if tensor_type in (Q.F32, Q.F16):
            writer.add_tensor(name, raw)
        else:
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=tensor_type)
        written[name] = raw
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def transformers_from_gguf(path, **kw):
    """transformers' own GGUF load of ``path``, the reference side, made faster without
    touching what it reads: `gguf`'s reader slices a numpy memmap ~3 M times (numpy's Python
    memmap hooks run on each) and transformers rebuilds gguf's tensor-name map 397 times for
    SmolLM2, ~25 s of a ~30 s load on these machines. Here the reader slices a plain array view
    of the same mapping and the name map is built once per architecture."""
    import functools
    from unittest import mock

    import torch
    import transformers

    class PlainData:
        def __get__(self, obj, owner=None):
            return obj.__dict__["data"]

        def __set__(self, obj, value):
            obj.__dict__["data"] = value.view(np.ndarray) if isinstance(value, np.memmap) \
                else value

    cached_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    with mock.patch.object(gguf.GGUFReader, "data", PlainData(), create=True), \
            mock.patch.object(gguf, "get_tensor_name_map", cached_map):
        return transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=kw.pop("dtype", torch.float32), **kw).eval()
