"""Session tests record real engine runs on a tiny random Llama built locally."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_testutil import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama_sessions")
    build_tiny_model("llama3_rope_gqa_tied", folder)
    return folder



@pytest.fixture(scope="session")
def hybrid_model_dir(tmp_path_factory):
    """Full-attention and sliding-window layers (window 6): two KV-cache groups."""
    folder = tmp_path_factory.mktemp("tiny_hybrid_sessions")
    build_tiny_model("qwen2_window_layers", folder)
    return folder
