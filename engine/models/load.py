"""Find a model (demo, local folder, or the local Hugging Face cache) and load it.

Only safetensors weights are loaded (pickle checkpoints can run code on load: refused). Nothing
is downloaded. Every failure a user can cause raises ``ModelLoadError`` with a one-line message.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvscope.engine.config import shown
from kvscope.engine.models import ModelConfig, UnsupportedModelError, get_model_class, gguf
from kvscope.engine.models.weights import (
    LoadedModel,
    ModelLoadError,
    meta_model,
    names_shown,
    resolve_dtype,
)

PICKLE_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_GENERIC_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")
_IGNORED_TENSORS = ("rotary_emb.inv_freq",)  # stale buffers some old checkpoints carry
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
# Multimodal checkpoints whose text model kvscope runs: architecture -> (the text model's
# architecture, transformers' config class for the text part, the text weights' prefixes as
# published (transformers 5 writes the first) -> the text model's own; other tensors are
# the vision tower's and are not read).
MULTIMODAL = {"Gemma3ForConditionalGeneration": (
    "Gemma3ForCausalLM", "Gemma3TextConfig",
    {"language_model.model.": "model.", "model.language_model.": "model.",
     "language_model.lm_head.": "lm_head.", "lm_head.": "lm_head."})}
_TOP_LEVEL = ("bos_token_id", "eos_token_id", "dtype", "torch_dtype")  # kept from the outer config
_SLIDING, _FULL = "sliding_attention", "full_attention"
# The built-in models: name -> (their folder in kvscope.resources, config.json fields over the
# folder's). "demo-hybrid" runs the demo's weights as a Ministral: a 128-token window on layers
# 0 and 2, full attention on 1 and 3, so two KV-cache groups, and blocks leave the window.
BUILT_IN: dict[str, tuple[str, dict[str, Any]]] = {
    "demo": ("demo", {}),
    "demo-hybrid": ("demo", {"architectures": ["MinistralForCausalLM"], "model_type": "ministral",
                             "sliding_window": 128,
                             "layer_types": [_SLIDING, _FULL, _SLIDING, _FULL]}),
}


def resolve_model(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None
                  ) -> Path:
    """A built-in model ("demo", "demo-hybrid"), a local folder, or a repo id already in the
    local Hugging Face cache."""
    name = os.fspath(name_or_path)
    if name in BUILT_IN:
        path = Path(os.fspath(importlib.resources.files("kvscope.resources") / BUILT_IN[name][0]))
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"the demo model is not built ({path} has no config.json); "
                                 "run scripts/build_demo_model.py")
        return path
    local = Path(name).expanduser()
    if local.is_dir():
        return local.resolve()
    if local.exists():
        raise ModelLoadError(f"{local} is a file; give the model's folder")
    if _looks_like_path(name):
        raise ModelLoadError(f"model folder not found: {local.absolute()}")

    from huggingface_hub import constants, snapshot_download

    cache = Path(cache_dir or constants.HF_HUB_CACHE)
    try:
        return Path(snapshot_download(name, cache_dir=cache, local_files_only=True))
    except Exception:  # not cached, invalid repo id, broken cache entry
        raise ModelLoadError(
            f"model {name!r} not found: no folder {local.absolute()} and not in the Hugging Face "
            f"cache at {cache} (nothing is downloaded: fetch it first, e.g. `hf download {name}`)"
        ) from None


def _looks_like_path(name: str) -> bool:
    return (os.path.isabs(name) or name.startswith((".", "~")) or "\\" in name
            or name.count("/") > 1 or name.endswith("/"))


def read_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"no config.json in {path} (not a Hugging Face model folder?)")
    try:
        cfg = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise ModelLoadError(f"cannot read {config_file}: {e}") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{config_file} must hold a JSON object, got a "
                             f"{type(cfg).__name__}")
    return cfg


def weight_files(path: Path) -> list[Path]:
    """The safetensors files holding the model, sorted by name (index json honoured)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, AttributeError, TypeError, RecursionError) as e:
            raise ModelLoadError(f"cannot read {index}: {e!r}") from None
        for n in names:
            _check_shard_inside(path, index, n)
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ModelLoadError(f"{index.name} lists shards missing from {path}: "
                                 + names_shown(missing))
        return [path / n for n in names]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted({p.name for pat in PICKLE_PATTERNS for p in path.glob(pat)})
    if pickles:
        raise ModelLoadError(
            f"{path} has only pickle checkpoints ({names_shown(pickles)}), which can run code when "
            "loaded; convert to safetensors first (kvscope loads *.safetensors only)")
    raise ModelLoadError(f"no *.safetensors weight files in {path}")


def _check_shard_inside(path: Path, index: Path, name) -> None:
    """A shard named by the index must be a plain file name or relative path that stays in
    the model folder, also after symlinks (the Hugging Face cache's links into its own
    ``blobs`` folder excepted)."""
    if not isinstance(name, str) or not name:
        raise ModelLoadError(f"{index}: a shard name must be a non-empty string, got {name!r}")
    if os.path.isabs(name) or ".." in Path(name).parts:
        raise ModelLoadError(f"{index} points outside the model folder: {name!r} (refused)")
    target = (path / name).resolve()
    roots = [path.resolve()]
    if path.parent.name == "snapshots":  # <cache>/models--org--name/snapshots/<revision>
        roots.append((path.parent.parent / "blobs").resolve())
    if not any(target.is_relative_to(r) for r in roots):
        raise ModelLoadError(f"{index}: shard {name!r} is a link to {target}, outside the model "
                             "folder (refused)")


def _read_header(fh) -> tuple[bytes, bytes]:
    """The 8-byte little-endian header length and the JSON header, nothing more."""
    length_bytes = fh.read(8)
    if len(length_bytes) != 8:
        raise ModelLoadError(f"{fh.name} is not a safetensors file (too short)")
    length = int.from_bytes(length_bytes, "little")
    if length > _MAX_HEADER_BYTES:
        raise ModelLoadError(f"{fh.name} is not a safetensors file (header length {length})")
    header = fh.read(length)
    if len(header) != length:
        raise ModelLoadError(f"{fh.name} is truncated inside its header")
    return length_bytes, header


def model_fingerprint(path: str | os.PathLike, overrides: dict[str, Any] | None = None) -> str:
    """sha256 over config.json (and the fields a built-in model sets over it) and each weight
    file's name, size and header (never the data).

    Cheap for multi-GB models. Two checkpoints that differ only in tensor values but have
    byte-identical headers and sizes get the same fingerprint.
    """
    path = Path(path)
    h = hashlib.sha256()
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"no config.json in {path} (not a Hugging Face model folder?)")
    h.update(b"config.json\0" + config_file.read_bytes())
    if overrides:
        h.update(json.dumps(overrides, sort_keys=True).encode())
    for f in weight_files(path):
        size = f.stat().st_size
        with open(f, "rb") as fh:
            length_bytes, header = _read_header(fh)
        h.update(f"\0{f.name}\0{size}\0".encode() + length_bytes + header)
    return h.hexdigest()


def text_model(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str] | None]:
    """A multimodal config.json's text model as a config.json of its own (its `text_config`
    with transformers' defaults filled in: published files name only what differs), and the
    renaming of its weights; any other config as it is, and None."""
    archs = cfg.get("architectures")
    arch = next((a for a in archs if a in MULTIMODAL), None) if isinstance(archs, list) else None
    if arch is None:
        return cfg, None
    text_arch, config_class, prefixes = MULTIMODAL[arch]
    text = cfg.get("text_config") or {}
    if not isinstance(text, dict):
        raise UnsupportedModelError(f"{arch}: text_config must be a JSON object, got "
                                    f"{shown(text)}")
    import transformers

    try:
        full = getattr(transformers, config_class)(**text).to_dict()
    except Exception as e:  # transformers' own check of a field
        raise UnsupportedModelError(f"{arch}: bad text_config: {str(e).splitlines()[0]}") \
            from None
    outer = {k: cfg[k] for k in _TOP_LEVEL if k in cfg}
    return {**full, **outer, "architectures": [text_arch]}, prefixes


def _renamed(key: str, prefixes: dict[str, str] | None) -> str | None:
    """A checkpoint tensor's name in the text model (None: not the text model's)."""
    if prefixes is None:
        return key
    for before, after in prefixes.items():
        if key.startswith(before):
            return after + key[len(before):]
    return None


def _check_weights(files: list[Path], expected: dict[str, tuple[int, ...]], tied: bool,
                   prefixes: dict[str, str] | None = None) -> None:
    """Compare checkpoint tensor names and shapes (headers only) against the model."""
    found: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(f, framework="pt") as sf:
                for key in sf.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if (name := _renamed(key, prefixes)) is not None:
                        found[name] = tuple(sf.get_slice(key).get_shape())
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"cannot read {f.name}: {e}") from None
    found = {k: v for k, v in found.items() if not k.endswith(_IGNORED_TENSORS)}
    if tied:
        found.pop("lm_head.weight", None)  # some tied checkpoints store it anyway
    problems = []
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = sorted(k for k in set(expected) & set(found) if expected[k] != found[k])
    if missing:
        problems.append("missing tensors " + names_shown(missing))
    if unexpected:
        problems.append("unexpected tensors " + names_shown(unexpected))
    if wrong:
        problems.append("shape mismatch " + names_shown(
            [f"{k} {list(found[k])} vs config {list(expected[k])}" for k in wrong]))
    if problems:
        raise ModelLoadError("weights do not match config.json: " + "; ".join(problems))


def _load_tokenizer(path: Path):
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    try:
        tokenizer_class = json.loads(
            (path / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError, AttributeError, RecursionError):
        tokenizer_class = None
    try:
        if tokenizer_class in _GENERIC_TOKENIZERS and (path / "tokenizer.json").is_file():
            # The class AutoTokenizer resolves this name to, minus AutoConfig's imports (~2 s).
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer in {path}: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def load_model(name_or_path: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: torch.dtype | str | None = None) -> LoadedModel:
    if gguf.is_gguf(name_or_path):
        return gguf.load_gguf(name_or_path, device, dtype)
    path = resolve_model(name_or_path)
    name = os.fspath(name_or_path)
    overrides = BUILT_IN[name][1] if name in BUILT_IN else {}
    if name not in BUILT_IN and Path(name).expanduser().is_dir():
        name = path.name
    try:
        hf_config, prefixes = text_model({**read_config(path), **overrides})
        config = ModelConfig.from_hf_dict(hf_config)
        model_cls = get_model_class(config.architecture)
    except UnsupportedModelError as e:
        raise ModelLoadError(f"{e} (in {path / 'config.json'})") from None
    except (KeyError, TypeError) as e:
        raise ModelLoadError(f"config.json in {path} lacks or mistypes field {e}") from None
    files = weight_files(path)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, config, device)

    model, expected = meta_model(model_cls, config)
    _check_weights(files, expected, config.tie_word_embeddings, prefixes)

    state: dict[str, torch.Tensor] = {}
    for f in files:  # each tensor is read once, converted, and kept
        with safe_open(f, framework="pt", device=str(device)) as sf:
            for key in sf.keys():  # noqa: SIM118
                if (renamed := _renamed(key, prefixes)) in expected:
                    state[renamed] = sf.get_tensor(key).to(dtype)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.requires_grad_(False).eval()

    return LoadedModel(model=model, config=config, tokenizer=_load_tokenizer(path),
                       fingerprint=model_fingerprint(path, overrides), path=path, name=name,
                       dtype=dtype, device=device, hf_config=hf_config)
