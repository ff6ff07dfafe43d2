"""GUI tests drive the real window, offscreen, with the demo model in its engine process
(helpers in window_testutil.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from window_testutil import open_window

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sessions"))


@pytest.fixture
def window(qtbot, tmp_path):
    w = open_window(qtbot, tmp_path)
    yield w
    w.close()


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """A demo-model session of 40-odd steps (12 requests, 30 tokens each)."""
    from kvscope.engine import Engine
    from kvscope.engine.config import EngineConfig, SamplingParams
    from kvscope.sessions import Recorder

    path = tmp_path_factory.mktemp("range") / "run.kvscope"
    engine = Engine.from_pretrained("demo", EngineConfig(num_blocks=32, block_size=16))
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    with Recorder(path, engine):
        for i in range(12):
            engine.add_request(f"Question {i} about lists and tuples? " * (1 + i % 3), params)
            engine.step()
        while engine.has_unfinished():
            engine.step()
    return path


@pytest.fixture
def fakes():
    """Three fake KV-event publishers (tests/sessions/kv_fake_publisher.py), for a fleet."""
    from kv_fake_publisher import FakePublisher

    fs = [FakePublisher() for _ in range(3)]
    yield fs
    for f in fs:
        f.close()
