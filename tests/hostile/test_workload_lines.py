"""Bad request fields in a workload file: `kvscope run` prints one line naming the file, the
line and the field, exits 2, and leaves the file as it was."""

from __future__ import annotations

import pytest
from hostile_testutil import assert_one_line_error

DEEP = 100_000
BAD_LINES = {  # id -> (the request line, *words the error must contain)
    "token id 2**63": ('{"prompt_ids": [1, 9223372036854775808]}',
                       "prompt_ids must be a list of integer token ids in [0, 2**63)"),
    "token id negative": ('{"prompt_ids": [1, -1]}', "prompt_ids must be"),
    "token id float": ('{"prompt_ids": [1, 2.0]}', "prompt_ids must be"),
    "token id 10**5000": ('{"prompt_ids": [1' + "0" * 5000 + "]}", "bad JSON", "digits"),
    "seed 2**70": ('{"prompt_ids": [1], "seed": 1180591620717411303424}',
                   "seed must be None or an integer in [0, 2**64)"),
    "seed -2**70": ('{"prompt_ids": [1], "seed": -1180591620717411303424}', "seed must be"),
    "temperature 1e-300": ('{"prompt_ids": [1], "temperature": 1e-300}',
                           "temperature must be 0 (greedy) or at least 1e-06"),
    "temperature 1e-320": ('{"prompt_ids": [1], "temperature": 1e-320}',
                           "temperature must be 0 (greedy) or at least"),
    "temperature NaN": ('{"prompt_ids": [1], "temperature": NaN}',
                        "temperature must be a finite number >= 0, got nan"),
    "temperature inf": ('{"prompt_ids": [1], "temperature": Infinity}',
                        "temperature must be a finite number"),
    "top_p NaN": ('{"prompt_ids": [1], "top_p": NaN}', "top_p must be in (0, 1]"),
    "n huge": ('{"prompt_ids": [1], "n": 100000}', "n must be at most 256"),
    "surrogate prompt": ('{"prompt": "a\\ud800b"}', "prompt is not valid text",
                         "lone surrogate"),
    "surrogate salt": ('{"prompt_ids": [1], "cache_salt": "t\\udfff"}',
                       "cache_salt is not valid text"),
    "surrogate stop": ('{"prompt_ids": [1], "stop": ["\\ud800"]}', "stop", "not valid text"),
    "surrogate prefix": ('{"define_prefix": "p", "text": "\\ud800"}', "prefix 'p' is not valid"),
    "empty stop": ('{"prompt_ids": [1], "stop": ""}', "stop must hold non-empty strings"),
    "empty stop in list": ('{"prompt_ids": [1], "stop": ["x", ""]}', "non-empty strings"),
    "arrival 1e300": ('{"prompt_ids": [1], "arrival_s": 1e300}',
                      "arrival_s must be a number of seconds in [0, 604800]"),
    "arrival NaN": ('{"prompt_ids": [1], "arrival_s": NaN}', "arrival_s must be"),
    "arrival -inf": ('{"prompt_ids": [1], "arrival_s": -Infinity}', "arrival_s must be"),
    "nested 100k deep": ('{"prompt_ids": ' + "[" * DEEP + "]" * DEEP + "}",
                         "bad JSON: nested too deeply"),
    "max_tokens bool": ('{"prompt_ids": [1], "max_tokens": true}',
                        "max_tokens must be an integer"),
}


@pytest.mark.parametrize("case", BAD_LINES.values(), ids=BAD_LINES.keys())
def test_a_bad_request_line_is_one_line_error(kvscope, tmp_path, tiny_model, case):
    line, *words = case
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt_ids": [3, 4, 5]}\n' + line + "\n", encoding="utf-8")
    before = path.read_bytes()
    message = assert_one_line_error(
        kvscope("run", "--workload", path, "--model", tiny_model, "--no-progress"),
        "w.jsonl:2: ", *words)
    assert len(message) < 200  # the offending value is cut short, not echoed whole
    assert path.read_bytes() == before


def test_a_token_id_beyond_the_vocabulary_names_the_line(kvscope, tmp_path, tiny_model):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt_ids": [3, 4]}\n{"prompt_ids": [3, 320]}\n', encoding="utf-8")
    assert_one_line_error(
        kvscope("run", "--workload", path, "--model", tiny_model, "--no-progress"),
        "w.jsonl:2: token id 320 in prompt_ids is beyond the model's vocabulary of 320")
    path.write_text('{"prompt_ids": [3, 319]}\n', encoding="utf-8")
    code, out, _ = kvscope("run", "--workload", path, "--model", tiny_model, "--no-progress")
    assert code == 0 and "1 finished" in out  # the last id of the vocabulary is fine
