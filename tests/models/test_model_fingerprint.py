"""model_fingerprint: stable, sensitive to the weight files, and reads only their headers."""

from __future__ import annotations

import builtins
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from kvscope.engine.models import load as loader
from kvscope.engine.models.load import ModelLoadError, load_model, model_fingerprint


@pytest.fixture
def folder(tiny_model_dir, tmp_path):
    copy = tmp_path / "m"
    shutil.copytree(tiny_model_dir("llama_mha"), copy)
    return copy


def header_end(path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_stable_and_matches_loaded_model(folder, tmp_path):
    first = model_fingerprint(folder)
    assert first == model_fingerprint(folder)
    assert load_model(folder).fingerprint == first
    moved = tmp_path / "elsewhere"
    shutil.copytree(folder, moved)  # identity is the content, not the location
    assert model_fingerprint(moved) == first


def test_changes_when_a_weight_file_changes(folder):
    before = model_fingerprint(folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"].double()  # new dtype in header
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    assert model_fingerprint(folder) != before


def test_changes_when_config_changes(folder):
    before = model_fingerprint(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (folder / "config.json").write_text(json.dumps(cfg))
    assert model_fingerprint(folder) != before


def test_tensor_data_is_never_read(folder, monkeypatch):
    weights = folder / "model.safetensors"
    end = header_end(weights)
    before = model_fingerprint(folder)

    # Corrupting the data region (same size) does not change the digest: it is not read.
    data = bytearray(weights.read_bytes())
    data[end:] = bytes(len(data) - end)
    weights.write_bytes(bytes(data))
    assert model_fingerprint(folder) == before

    # Count what is actually read from the weight file.
    read_bytes = []
    real_open = builtins.open

    class CountingFile:
        def __init__(self, f):
            self._f = f

        def read(self, n=-1):
            chunk = self._f.read(n)
            read_bytes.append(len(chunk))
            return chunk

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    def counting_open(path, *args, **kwargs):
        f = real_open(path, *args, **kwargs)
        return CountingFile(f) if str(path).endswith(".safetensors") else f

    monkeypatch.setattr(loader, "open", counting_open, raising=False)
    assert model_fingerprint(folder) == before
    assert sum(read_bytes) == end < weights.stat().st_size
    monkeypatch.undo()

    # A file truncated after its header still gets a digest (the size is part of it).
    weights.write_bytes(bytes(data[:end + 16]))
    truncated = model_fingerprint(folder)
    assert len(truncated) == 64 and truncated != before


def test_broken_header_is_a_load_error(folder):
    (folder / "model.safetensors").write_bytes(b"\x00\x01")
    with pytest.raises(ModelLoadError, match="not a safetensors file"):
        model_fingerprint(folder)
