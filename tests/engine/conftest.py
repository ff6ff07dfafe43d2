"""Engine tests run real forward passes on a tiny random Llama built locally."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from model_testutil import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(folder, the transformers model) of a tiny random GQA Llama."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    return folder, build_tiny_model("llama3_rope_gqa_tied", folder)

