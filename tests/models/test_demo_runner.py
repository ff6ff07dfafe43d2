"""The built-in demo model loads quickly through our loader and generates text with our runner."""

from __future__ import annotations

import importlib.resources
import time
from pathlib import Path

import pytest
from model_testutil import BlockAllocator, PagedSeq, greedy_decode

from kvscope.engine.model_runner import ModelRunner
from kvscope.engine.models.load import load_model

DEMO_DIR = Path(str(importlib.resources.files("kvscope.resources") / "demo"))
MAX_LOAD_SECONDS = 3.0

pytestmark = pytest.mark.skipif(
    not (DEMO_DIR / "config.json").is_file() or not any(DEMO_DIR.glob("*.safetensors")),
    reason=f"demo model not built in {DEMO_DIR} (run scripts/build_demo_model.py)")


def test_demo_loads_fast_and_generates_text():
    start = time.perf_counter()
    loaded = load_model("demo")
    elapsed = time.perf_counter() - start
    assert elapsed < MAX_LOAD_SECONDS, f"demo load took {elapsed:.2f} s"
    assert loaded.name == "demo" and loaded.tokenizer is not None

    block_size = 16
    runner = ModelRunner(loaded, num_blocks=32, block_size=block_size)
    prompt = loaded.tokenizer.encode("The for statement is used to iterate over")
    seq = PagedSeq(prompt, BlockAllocator(32, seed=1), block_size)
    tokens, _ = greedy_decode(runner, [seq], runner.run([seq.chunk()]), 32)

    naive_seq, naive_tokens = list(prompt), []
    for _ in range(32):
        naive_tokens.append(int(runner.run_naive([naive_seq])[0].argmax()))
        naive_seq.append(naive_tokens[-1])
    assert tokens[0] == naive_tokens

    text = loaded.tokenizer.decode(tokens[0], skip_special_tokens=True)
    assert text.strip(), "the demo model generated no text"
