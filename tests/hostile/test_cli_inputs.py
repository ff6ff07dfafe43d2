"""Bad command-line values: one line naming the option, exit 2, before any model is loaded
where the value alone is wrong; nothing is created or changed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hostile_testutil import assert_one_line_error, write_jsonl

from kvscope.app.host.server import cpu_cores

BAD_GENERATE = {  # id -> (options, *words the error must contain)
    "empty stop": (["--stop", ""], "--stop must hold non-empty strings"),
    "seed 2**70": (["--seed", str(2**70)], "--seed must be None or an integer in [0, 2**64)"),
    "seed -2**70": (["--seed", str(-2**70)], "--seed must be"),
    "temperature 1e-300": (["--temperature", "1e-300"], "--temperature must be 0 (greedy) or"),
    "temperature 1e-320": (["--temperature", "1e-320"], "--temperature must be 0 (greedy) or"),
    "temperature nan": (["--temperature", "nan"], "--temperature must be a finite number"),
    "temperature inf": (["--temperature", "inf"], "--temperature must be a finite number"),
    "top-p nan": (["--top-p", "nan"], "--top-p must be in (0, 1]"),
    "n huge": (["-n", "100000"], "-n must be at most 256"),
    "salt surrogate": (["--cache-salt", "t\udcff"], "--cache-salt is not valid text"),
    "prompt surrogate": (["--", "a\udcffb"], "prompt 2 is not valid text", "lone surrogate"),
}


@pytest.mark.parametrize("case", BAD_GENERATE.values(), ids=BAD_GENERATE.keys())
def test_bad_generate_option_is_one_line(kvscope, case, monkeypatch):
    options, *words = case

    def no_load(args):  # the value alone is wrong: refused before any model is loaded
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("kvscope.app.cli.common.load_engine", no_load)
    assert_one_line_error(kvscope("generate", "hello", *options), *words)


@pytest.fixture
def workload(tmp_path) -> Path:
    return write_jsonl(tmp_path / "w.jsonl", {"prompt_ids": [3, 4, 5, 6, 7], "max_tokens": 2},
                       {"prompt_ids": list(range(3, 40)), "max_tokens": 2})


def run(kvscope, workload, model, *options):
    return kvscope("run", "--workload", workload, "--model", model, "--no-progress", *options)


@pytest.mark.parametrize("value", ["2x", "0", "-3", "1.5", "nanGiB", "GiB"])
def test_a_bad_host_tier_size_exits_2_naming_the_option(kvscope, workload, tiny_model, value):
    code, _, err = run(kvscope, workload, tiny_model, "--host-blocks", value)
    assert code == 2 and "Traceback" not in err  # argparse's usage, then its one error line
    assert err.strip().splitlines()[-1].endswith(
        f"argument --host-blocks: {value!r} is not a host size (a number of blocks, or a size "
        "such as 4GiB or 512MiB)")


@pytest.mark.parametrize("value, words", [
    ("100000000000", ("the host tier needs", "100000000000 blocks x 16 tokens")),
    ("0.0001MB", ("host_bytes 100 holds no block of",)),
])
def test_a_host_tier_that_cannot_be_is_one_line(kvscope, workload, tiny_model, value, words):
    assert_one_line_error(run(kvscope, workload, tiny_model, "--host-blocks", value), *words)


def test_threads_beyond_the_cpus_is_one_line(kvscope, workload, tiny_model):
    assert_one_line_error(run(kvscope, workload, tiny_model, "--threads", "100000"),
                          f"--threads 100000: this process may use {cpu_cores()} CPUs")


@pytest.mark.parametrize("options, words", [
    (["--num-blocks", "100000000"], "100000000 blocks x 16 tokens"),
    (["--block-size", "1000000000"], "2048 blocks x 1000000000 tokens"),
])
def test_an_absurd_pool_says_what_it_needs_and_what_there_is(kvscope, workload, tiny_model,
                                                              options, words):
    import psutil

    message = assert_one_line_error(run(kvscope, workload, tiny_model, *options),
                                    "the KV pool needs", words, "memory is available")
    need_gib, have_gib = (float(x.split()[0].replace(",", ""))
                          for x in message.split("needs ")[1].split("only ")[:2])
    assert need_gib > have_gib
    assert have_gib == pytest.approx(psutil.virtual_memory().available / 2**30, rel=0.25)


def test_record_into_a_missing_folder_fails_before_the_model_loads(kvscope, workload,
                                                                   tmp_path, monkeypatch):
    monkeypatch.setattr("kvscope.app.cli.common.load_engine", lambda a: pytest.fail("loaded"))
    target = tmp_path / "no" / "such" / "s.kvscope"
    assert_one_line_error(run(kvscope, workload, "demo", "--record", target),
                          f"--record: the folder {target.parent} does not exist")
    assert not (tmp_path / "no").exists()


def test_record_into_a_read_only_place_fails_before_the_model_loads(kvscope, workload,
                                                                    tmp_path, monkeypatch):
    monkeypatch.setattr("kvscope.app.cli.common.load_engine", lambda a: pytest.fail("loaded"))
    if os.geteuid() == 0:  # root writes anywhere a mode allows; sysfs refuses even root
        folder = Path("/sys")
    else:
        folder = tmp_path / "ro"
        folder.mkdir(mode=0o500)
    before = sorted(os.listdir(folder))
    assert_one_line_error(run(kvscope, workload, "demo", "--record", folder / "s.kvscope"),
                          f"--record: cannot create {folder / 's.kvscope'}",
                          "Permission denied")
    assert sorted(os.listdir(folder)) == before


def test_record_onto_an_existing_file_names_the_overwrite_option(kvscope, workload, tmp_path,
                                                                  monkeypatch):
    monkeypatch.setattr("kvscope.app.cli.common.load_engine", lambda a: pytest.fail("loaded"))
    target = tmp_path / "s.kvscope"
    target.write_bytes(b"keep me")
    message = assert_one_line_error(run(kvscope, workload, "demo", "--record", target),
                                    "exists (pass --overwrite to replace it)")
    assert "overwrite=True" not in message
    assert target.read_bytes() == b"keep me"


def test_a_run_where_every_request_is_rejected_says_why_and_exits_2(kvscope, workload,
                                                                    tiny_model):
    code, out, err = run(kvscope, workload, tiny_model, "--num-blocks", "1", "--block-size",
                         "4")
    assert code == 2
    assert "Traceback" not in err
    assert "2 rejected" in out  # the summary is still printed
    head, *reasons = err.strip().splitlines()
    assert head == "kvscope: error: all 2 requests were rejected:"
    assert sorted(reasons) == [  # each distinct reason with its count
        "  1 x prompt (37 tokens) + max_tokens (2) needs 10 blocks of 4 tokens; the KV pool "
        "has only 1",
        "  1 x prompt (5 tokens) + max_tokens (2) needs 2 blocks of 4 tokens; the KV pool has "
        "only 1"]


def test_a_run_where_some_requests_are_rejected_says_why_and_exits_0(kvscope, workload,
                                                                     tiny_model):
    code, out, err = run(kvscope, workload, tiny_model, "--num-blocks", "3", "--block-size",
                         "4")
    assert code == 0
    assert "1 finished, 1 rejected" in out
    assert err.strip().splitlines() == [
        "kvscope: 1 of 2 requests were rejected: prompt (37 tokens) + max_tokens (2) needs 10 "
        "blocks of 4 tokens; the KV pool has only 3"]


@pytest.mark.parametrize("where, words", [
    ("existing", "exists (pass --overwrite to replace it)"),
    ("missing folder", "does not exist"),
    ("a folder", "is a folder; give a file name"),
])
def test_attach_record_path_is_checked_like_run(kvscope, tmp_path, where, words):
    """`kvscope attach --headless --record` refuses a file it must not or cannot write in one
    line, before listening, as `kvscope run --record` does; nothing is created or changed."""
    target = {"existing": tmp_path / "s.kvscope", "missing folder": tmp_path / "no" / "s.kvscope",
              "a folder": tmp_path}[where]
    if where == "existing":
        target.write_bytes(b"keep me")
    before = sorted(os.listdir(tmp_path))
    assert_one_line_error(kvscope("attach", "tcp://127.0.0.1:1", "--headless", "--duration",
                                  "0.1", "--record", target), "--record:", words)
    assert sorted(os.listdir(tmp_path)) == before
    if where == "existing":
        assert target.read_bytes() == b"keep me"


BAD_ATTACH = {  # id -> (options, *words the error must contain)
    "version not a version": (["--vllm-version", "latest"], "--vllm-version 'latest': not a "
                              "vLLM version (X.Y or X.Y.Z"),
    "version empty": (["--vllm-version", ""], "--vllm-version '': not a vLLM version"),
    "version before KV events": (["--vllm-version", "0.8.5"], "--vllm-version 0.8.5: vLLM "
                                 "publishes KV events since 0.9.0"),
    "lora path without =": (["--lora-path", "adapter-a"], "--lora-path 'adapter-a': give "
                            "NAME=PATH"),
    "lora path without name": (["--lora-path", "=/adapters/a"], "give NAME=PATH"),
    "lora path without path": (["--lora-path", "adapter-a="], "give NAME=PATH"),
    "lora path twice": (["--lora-path", "a=/x", "--lora-path", "a=/y"],
                        "--lora-path a: given twice with different paths"),
}


@pytest.mark.parametrize("headless", [True, False], ids=["headless", "window"])
@pytest.mark.parametrize("case", BAD_ATTACH.values(), ids=BAD_ATTACH.keys())
def test_bad_attach_parity_option_is_one_line(kvscope, case, headless, monkeypatch):
    """--vllm-version and --lora-path are refused before anything listens or a window opens."""
    options, *words = case
    monkeypatch.setattr("kvscope.app.window.gui.run_gui", lambda **kw: pytest.fail("window opened"))
    monkeypatch.setattr("kvscope.sessions.kv_events.session.AttachSession",
                        lambda *a, **kw: pytest.fail("listened"))
    assert_one_line_error(kvscope("attach", "tcp://127.0.0.1:1", "--hash-check", "sha256",
                                  *options, *(["--headless", "--duration", "0.1"] if headless
                                              else [])), "kvscope: error:", *words)
