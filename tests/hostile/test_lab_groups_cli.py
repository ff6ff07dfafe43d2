"""`kvscope lab --groups`: a bad KV-cache group list, and belady with windows only, are one line
naming the value, exit 2, before the trace is replayed."""

from __future__ import annotations

from pathlib import Path

import pytest
from hostile_testutil import assert_one_line_error

HEAD = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_head200.jsonl"


@pytest.mark.parametrize("value, words", [
    ("", ["--groups: KV-cache groups ''", "'' is not a group"]),
    ("window:0", ["'window:0' is not a group", "e.g. full,window:1024"]),
    ("window:-8", ["'window:-8' is not a group"]),
    ("window:1e3", ["'window:1e3' is not a group"]),
    ("window", ["'window' is not a group"]),
    ("full:4096", ["'full:4096' is not a group"]),
    ("sliding:512", ["'sliding:512' is not a group"]),
    ("full,,window:8", ["'' is not a group"]),
    ("full,window:8,full", ["'full' is there twice"]),
    ("window:8,window:08", ["'window:08' is there twice"]),
])
def test_a_bad_group_list_is_one_line(kvscope, value, words, monkeypatch):
    def no_load(*args):
        raise AssertionError("the trace was read")

    monkeypatch.setattr("kvscope.app.cli.lab.load_lab_input", no_load)
    assert_one_line_error(kvscope("lab", HEAD, "--groups", value), *words)


def test_belady_with_windows_only_is_one_line(kvscope):
    assert_one_line_error(
        kvscope("lab", HEAD, "--limit", "5", "--groups", "window:4096", "--policy", "belady"),
        "--policy: belady is the full-attention ceiling", "window:4096", "leave belady out")
    code, out, _ = kvscope("lab", HEAD, "--limit", "5", "--groups", "window:4096",
                           "--pool-blocks", "100")
    assert code == 0 and "belady" not in out  # left out by default there
