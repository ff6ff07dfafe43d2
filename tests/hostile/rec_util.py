"""Helpers for the tests/hostile/test_rec_* files (recording, export, privacy): the tiny random
Llama of tests/sessions and its seeded workload. A uniquely named module, not conftest."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
for folder in ("models", "sessions"):
    if str(TESTS / folder) not in sys.path:
        sys.path.insert(0, str(TESTS / folder))

from model_testutil import build_tiny_model  # noqa: E402
from session_testutil import drive, make_engine  # noqa: E402, F401 - re-exported


@pytest.fixture(scope="session")
def rec_model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama_rec")
    build_tiny_model("llama3_rope_gqa_tied", folder)
    return folder


def record(path, model_dir, max_steps: int = 40, **kw) -> Path:
    from kvscope.sessions import Recorder

    engine = make_engine(model_dir)
    with Recorder(path, engine, **kw):
        drive(engine, max_steps=max_steps)
    return Path(path)
