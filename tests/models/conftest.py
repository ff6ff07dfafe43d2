"""Fixtures for tests/models (helpers live in model_testutil)."""

from __future__ import annotations

import pytest
from model_testutil import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """spec name -> folder with that model saved (built once per session)."""
    built: dict[str, object] = {}

    def get(spec: str):
        if spec not in built:
            folder = tmp_path_factory.mktemp(spec)
            build_tiny_model(spec, folder)
            built[spec] = folder
        return built[spec]

    return get
