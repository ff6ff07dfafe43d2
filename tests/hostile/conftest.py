"""Hostile inputs: every bad value a user can give gets exit status 2, one line on stderr that
names the problem, no traceback, and leaves its input files as they were."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_testutil import build_tiny_model  # noqa: E402

from kvscope.app.cli import main as cli  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama (vocab 320, no tokenizer) saved as a real model folder."""
    folder = tmp_path_factory.mktemp("hostile_llama")
    build_tiny_model("llama3_rope_gqa_tied", folder)
    return folder


@pytest.fixture
def kvscope(capsys):
    """Run the `kvscope` command in-process: (exit status, stdout, stderr). argparse's own
    errors (SystemExit) count as an exit status too."""

    def run(*argv: str) -> tuple[int, str, str]:
        try:
            code = cli.main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        return code, out, err

    return run
