"""`kvscope lab --host-blocks`: a bad host size, a size in GiB without the bytes it needs, a
size that holds no block are one line naming the value,
exit 2 (the sizes before the trace is read)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hostile_testutil import assert_one_line_error

HEAD = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_head200.jsonl"


@pytest.mark.parametrize("value, extra, words", [
    ("", [], ["--host-blocks: '' is not a host size", "a size such as 4GiB or 512MiB"]),
    ("0", [], ["'0' is not a host size"]),
    ("-8000", [], ["'-8000' is not a host size"]),
    ("1e4", [], ["'1e4' is not a host size"]),
    ("4TB", ["--kv-bytes-per-token", "1024"], ["'4TB' is not a host size"]),
    ("8000,", [], ["'' is not a host size"]),
    ("4GiB", [], ["'4GiB': a size needs --kv-bytes-per-token"]),
    ("0.000001GiB", ["--kv-bytes-per-token", "65536"],
     ["'0.000001GiB' holds no block of 1,048,576 bytes"]),
    ("8000,8_000", [], ["'8_000' is not a host size"]),
    ("8000,8000", [], ["'8000,8000' names a host size twice"]),
])
def test_a_bad_host_size_is_one_line(kvscope, value, extra, words, monkeypatch):
    def no_load(*args):
        raise AssertionError("the trace was read")

    monkeypatch.setattr("kvscope.app.cli.lab.load_lab_input", no_load)
    assert_one_line_error(kvscope("lab", HEAD, "--host-blocks", value, *extra), *words)


def test_a_bad_bytes_per_token_is_argparse_s_error(kvscope):
    """(argparse's own: the usage, then one error line.)"""
    code, _, err = kvscope("lab", HEAD, "--kv-bytes-per-token", "0")
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith(
        "argument --kv-bytes-per-token: must be at least 1, got 0")
