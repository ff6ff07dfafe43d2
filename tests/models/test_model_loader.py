"""resolve_model / load_model: where models come from, and one clear error per failure."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from model_testutil import LOGIT_ATOL, build_tiny_model, random_prompt
from safetensors.torch import load_file, save_file

from kvscope.engine.model_runner import ModelRunner
from kvscope.engine.models.architectures import ARCHITECTURES
from kvscope.engine.models.load import ModelLoadError, load_model, resolve_model


@pytest.fixture
def llama_dir(tiny_model_dir, tmp_path):
    """A private copy of the tiny Llama folder that a test may damage."""
    folder = tmp_path / "llama"
    shutil.copytree(tiny_model_dir("llama_mha"), folder)
    return folder


def edit_config(folder, **changes):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def last_logits(loaded, prompt):
    return ModelRunner(loaded, num_blocks=2, block_size=4).run_naive([prompt])[0]


def test_loads_local_folder(llama_dir):
    loaded = load_model(llama_dir)
    assert loaded.name == "llama" and loaded.path == llama_dir.resolve()
    assert loaded.config.architecture == "LlamaForCausalLM"
    assert loaded.tokenizer is None  # this folder has no tokenizer files
    assert len(loaded.fingerprint) == 64
    assert all(p.device.type == "cpu" and p.dtype == torch.float32
               for p in loaded.model.parameters())


def test_pickle_only_checkpoint_is_refused(llama_dir):
    (llama_dir / "model.safetensors").unlink()
    (llama_dir / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ModelLoadError, match="pickle.*pytorch_model.bin.*convert to safetensors"):
        load_model(llama_dir)


def test_missing_config_json(llama_dir):
    (llama_dir / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json in .*llama"):
        load_model(llama_dir)


def test_no_weight_files(llama_dir):
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weight files"):
        load_model(llama_dir)


def test_unsupported_architecture_names_the_supported_ones(llama_dir):
    edit_config(llama_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError) as err:
        load_model(llama_dir)
    msg = str(err.value)
    assert "unsupported architecture (GPT2LMHeadModel)" in msg
    assert all(a.hf_name in msg for a in ARCHITECTURES)
    assert "\n" not in msg


def test_unsupported_rope_type(llama_dir):
    edit_config(llama_dir, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4})
    with pytest.raises(ModelLoadError, match="unsupported rope type 'yarn'"):
        load_model(llama_dir)


def test_missing_tensor_is_named(llama_dir):
    weights = load_file(llama_dir / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, llama_dir / "model.safetensors")
    with pytest.raises(ModelLoadError,
                       match="missing tensors model.layers.1.mlp.up_proj.weight"):
        load_model(llama_dir)


def test_unexpected_tensor_is_named(llama_dir):
    weights = load_file(llama_dir / "model.safetensors")
    weights["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)  # ignored
    save_file(weights, llama_dir / "model.safetensors")
    with pytest.raises(ModelLoadError) as err:
        load_model(llama_dir)
    assert "unexpected tensors model.layers.0.self_attn.extra.weight" in str(err.value)
    assert "inv_freq" not in str(err.value)


def test_shape_mismatch_is_named(llama_dir):
    edit_config(llama_dir, intermediate_size=128)
    with pytest.raises(ModelLoadError, match=r"shape mismatch model.layers.0.mlp.down_proj.weight "
                                             r"\[64, 96\] vs config \[64, 128\]"):
        load_model(llama_dir)


def test_name_not_found_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError) as err:
        resolve_model("nobody/no-such-model", cache_dir=tmp_path / "hub")
    msg = str(err.value)
    assert "'nobody/no-such-model' not found" in msg
    assert str(tmp_path / "hub") in msg and "nothing is downloaded" in msg
    with pytest.raises(ModelLoadError, match="model folder not found: .*missing/model"):
        load_model("./missing/model")


def test_found_in_local_hf_cache(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    shutil.copytree(tiny_model_dir("llama_mha"), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    path = resolve_model("tiny-org/tiny-llama", cache_dir=tmp_path / "hub")
    assert path == repo / "snapshots" / commit
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    loaded = load_model("tiny-org/tiny-llama")
    assert loaded.name == "tiny-org/tiny-llama"


def test_sharded_checkpoint_loads_like_single_file(tmp_path, tiny_model_dir):
    model = build_tiny_model("qwen2_gqa_tied", tmp_path / "one")
    model.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="40KB")
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    prompt = random_prompt(9, seed=2)
    single = last_logits(load_model(tmp_path / "one"), prompt)
    sharded = last_logits(load_model(tmp_path / "sharded"), prompt)
    assert (single - sharded).abs().max().item() <= LOGIT_ATOL

    (tmp_path / "sharded" / shards[-1]).unlink()
    with pytest.raises(ModelLoadError, match=f"lists shards missing .*{shards[-1]}"):
        load_model(tmp_path / "sharded")


def test_dtype_policy(tmp_path):
    build_tiny_model("llama_mha", tmp_path, dtype=torch.bfloat16)
    loaded = load_model(tmp_path)  # bf16 checkpoint, CPU: upcast for speed
    assert loaded.config.torch_dtype == "bfloat16"
    assert loaded.dtype == torch.float32
    assert next(loaded.model.parameters()).dtype == torch.float32
    forced = load_model(tmp_path, dtype="bfloat16")
    assert {p.dtype for p in forced.model.parameters()} == {torch.bfloat16}
    runner = ModelRunner(forced, num_blocks=4, block_size=8)
    assert runner.kv_cache.dtype == torch.bfloat16  # "auto" follows the model
    prompt = random_prompt(10, seed=3)
    diff = (last_logits(loaded, prompt) - last_logits(forced, prompt)).abs().max().item()
    assert diff < 0.1
    with pytest.raises(ModelLoadError, match="unknown dtype 'int8'"):
        load_model(tmp_path, dtype="int8")


def test_tokenizer_is_loaded_when_present(llama_dir):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "paged": 4, "world": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(llama_dir)
    loaded = load_model(llama_dir)
    assert loaded.tokenizer.encode("hello paged world", add_special_tokens=False) == [3, 4, 5]
