"""The built-in demo model in resources/demo loads offline and is not noise.

Built by ``scripts/build_demo_model.py``; these tests check the committed
folder, not a fresh build.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# KVSCOPE_DEMO_DIR points the tests at another build (e.g. scripts/build_demo_model.py --out).
DEMO_DIR = Path(
    os.environ.get("KVSCOPE_DEMO_DIR")
    or Path(__file__).resolve().parent.parent / "resources" / "demo"
)
MAX_CHECKPOINT_BYTES = 8 * 1024 * 1024

# Common English words that occur throughout the training text (pydoc topics).
ENGLISH_WORDS = {
    "the", "of", "is", "to", "and", "a", "an", "in", "that", "for", "be", "are", "or", "it",
    "as", "with", "by", "this", "not", "if", "on", "can", "which", "from", "object", "function",
    "value", "name", "statement", "expression", "type", "class", "method", "when", "used",
}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO_DIR), local_files_only=True)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(
        str(DEMO_DIR), dtype=torch.float32, local_files_only=True
    )
    m.eval()
    return m


def test_files_present_and_checkpoint_small():
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (DEMO_DIR / name).is_file(), name
    ckpt = DEMO_DIR / "model.safetensors"
    assert ckpt.is_file()
    size = ckpt.stat().st_size
    assert 1_000_000 < size < MAX_CHECKPOINT_BYTES, size


def test_config_shapes():
    cfg = json.loads((DEMO_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    assert cfg["num_attention_heads"] > cfg["num_key_value_heads"]  # GQA
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert cfg["hidden_size"] == cfg["num_attention_heads"] * cfg["head_dim"]
    assert cfg["tie_word_embeddings"] is True


def test_weights_are_bfloat16_and_tied():
    from safetensors import safe_open

    with safe_open(str(DEMO_DIR / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        assert "model.embed_tokens.weight" in keys
        assert "lm_head.weight" not in keys  # tied to the embedding
        for k in keys:
            assert f.get_slice(k).get_dtype() == "BF16", k


def test_tokenizer_special_tokens(tokenizer, model):
    cfg = model.config
    assert tokenizer.bos_token == "<|bos|>"
    assert tokenizer.eos_token == "<|eos|>"
    assert tokenizer.pad_token == "<|pad|>"
    assert tokenizer.bos_token_id == cfg.bos_token_id
    assert tokenizer.eos_token_id == cfg.eos_token_id
    assert tokenizer.pad_token_id == cfg.pad_token_id
    assert len(tokenizer) == cfg.vocab_size


@pytest.mark.parametrize(
    "text",
    [
        "The quick brown fox jumps over the lazy dog.",
        "A function's __doc__ string isn't  always set; see PEP 257 (2001)!\n\tindented",
        "Unicode: naïve café, 東京, emoji 🙂.",
    ],
)
def test_tokenizer_round_trip(tokenizer, text):
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # Byte-level BPE compresses English well below one token per character.
    if text.isascii():
        assert len(ids) < len(text) * 0.6


def test_greedy_generation_writes_english(tokenizer, model):
    ids = tokenizer("The", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=20, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    new = out[0, ids.shape[1] :]
    assert len(new) >= 10
    text = tokenizer.decode(new, skip_special_tokens=True)
    words = re.findall(r"[a-z]+", text.lower())
    found = {w for w in words if w in ENGLISH_WORDS}
    assert len(found) >= 3, f"too few English words in {text!r}"
    # Not stuck on one token.
    assert len(set(new.tolist())) >= 5, text


def test_model_prefers_real_text(tokenizer, model):
    """Loss on English prose is well below chance (ln 2048 ~ 7.6) and below shuffled tokens."""
    text = (
        "The return statement leaves the current function call with the expression list "
        "as the return value. If the expression list is not present, None is substituted."
    )
    ids = tokenizer(text, return_tensors="pt").input_ids
    g = torch.Generator().manual_seed(0)
    shuffled = torch.cat(
        [ids[:, :1], ids[:, 1:][:, torch.randperm(ids.shape[1] - 1, generator=g)]], 1
    )
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
        loss_shuffled = model(input_ids=shuffled, labels=shuffled).loss.item()
    assert loss < 5.5, loss
    assert loss < loss_shuffled - 1.0, (loss, loss_shuffled)
