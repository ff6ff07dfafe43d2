"""The architecture table is the one seam: a new row alone makes a model load, with its quirks."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from model_testutil import hf_greedy, random_prompt

from kvscope.engine import Engine, EngineConfig, SamplingParams
from kvscope.engine.models import architectures
from kvscope.engine.models.architectures import Architecture
from kvscope.engine.models.load import ModelLoadError, load_model

NEW = Architecture("KvscopeTestForCausalLM", "kvscopetest", "qwen2", qkv_bias=True)


@pytest.fixture
def renamed(tiny_model_dir, tmp_path):
    """A Qwen2 checkpoint (q/k/v biases) whose config.json names an architecture no row has."""
    folder = tmp_path / "renamed"
    shutil.copytree(tiny_model_dir("qwen2_gqa_tied"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = [NEW.hf_name]
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_a_new_row_alone_makes_a_folder_load_with_its_quirks(renamed, tiny_model_dir,
                                                              monkeypatch):
    with pytest.raises(ModelLoadError, match=f"unsupported architecture \\({NEW.hf_name}\\)"):
        load_model(renamed)
    monkeypatch.setattr(architectures, "ARCHITECTURES", (*architectures.ARCHITECTURES, NEW))
    loaded = load_model(renamed)
    assert loaded.config.architecture == NEW.hf_name and loaded.config.qkv_bias
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("qwen2_gqa_tied"), dtype=torch.float32).eval()
    prompt = random_prompt(13, seed=4)
    want, _ = hf_greedy(hf, prompt, 8)
    engine = Engine(loaded, EngineConfig(block_size=4, num_blocks=64))
    got = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    assert got == want
    plain = Architecture(NEW.hf_name, NEW.gguf_name, "qwen2")  # the same row without the bias
    monkeypatch.setattr(architectures, "ARCHITECTURES", (*architectures.ARCHITECTURES[:-1], plain))
    with pytest.raises(ModelLoadError, match="unexpected tensors"):
        load_model(renamed)


def test_messages_list_every_row(monkeypatch):
    monkeypatch.setattr(architectures, "ARCHITECTURES", (*architectures.ARCHITECTURES, NEW))
    assert NEW.hf_name in architectures.supported()
    assert NEW.gguf_name in architectures.supported("gguf_name")
    assert architectures.by_gguf_name("kvscopetest") is NEW
