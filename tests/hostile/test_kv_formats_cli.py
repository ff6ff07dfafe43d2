"""`kvscope experiment kv-formats --prompts FILE` with a bad file: one line, exit 2."""

from __future__ import annotations

import pytest
from hostile_testutil import assert_one_line_error


@pytest.mark.parametrize("name, content, words", [
    ("missing.jsonl", None, ["missing.jsonl: no such file"]),
    ("bad.jsonl", '{"prompt": 3}\n', ["bad.jsonl:1", "prompt"]),
    ("short.jsonl", '{"prompt_ids": [5]}\n', ["short.jsonl: no prompt of 2 tokens or more"]),
    ("junk.kvscope", "not a database", ["junk.kvscope"]),
])
def test_a_bad_prompt_file_is_one_line(kvscope, tmp_path, name, content, words):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    assert_one_line_error(kvscope("experiment", "kv-formats", "--quick", "--prompts", path),
                          *words)


def test_prompts_belong_to_kv_formats_only(kvscope, tmp_path):
    assert_one_line_error(kvscope("experiment", "fp8", "--quick", "--prompts", tmp_path),
                          "--prompts applies to kv-formats only")
