"""The `kvscope` command, run in-process through main(): the printed summary against the
engine's own records, generate, the default action, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from kvscope.app.cli import main as cli
from kvscope.app.cli.common import DEFAULT_WORKLOAD
from kvscope.engine import Engine, SamplingParams


@pytest.fixture
def engines(monkeypatch):
    """Every engine the CLI builds, for checking its output against the engine's records."""
    built = []
    original = Engine.from_pretrained.__func__

    def from_pretrained(cls, model, config=None):
        engine = original(cls, model, config)
        built.append(engine)
        return engine

    monkeypatch.setattr(Engine, "from_pretrained", classmethod(from_pretrained))
    return built


def row(out: str, name: str) -> str:
    (line,) = [x for x in out.splitlines() if x.strip().startswith(name + "  ")]
    return line.strip()[len(name):].strip()


def numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"\d+(?:\.\d+)?", text)]


def check_summary_against_engine(out: str, engine: Engine) -> None:
    snap = engine.snapshot()
    reqs = engine.requests.values()
    finished = sum(r.finish_reason in ("length", "eos", "stop") for r in reqs)
    assert row(out, "requests").startswith(f"{finished} finished, 0 rejected, 0 cancelled")
    assert numbers(row(out, "token hit rate")) == [
        round(100 * snap.hit_tokens / snap.query_tokens, 1), snap.hit_tokens, snap.query_tokens]
    assert numbers(row(out, "request hit rate")) == [
        round(100 * snap.num_requests_hit / snap.num_requests_queried, 1),
        snap.num_requests_hit, snap.num_requests_queried]
    assert numbers(row(out, "evictions")) == [engine.manager.pool.num_evicted]
    assert numbers(row(out, "preemptions")) == [sum(r.num_preempted
                                                    for r in engine.step_records)]
    assert numbers(row(out, "steps"))[0] == len(engine.step_records)
    assert numbers(row(out, "tokens")) == [sum(r.metrics.prompt_tokens for r in reqs),
                                           sum(r.metrics.output_tokens for r in reqs)]
    ttft = sorted(r.metrics.ttft_s for r in reqs)
    mid = len(ttft) // 2
    p50 = ttft[mid] if len(ttft) % 2 else (ttft[mid - 1] + ttft[mid]) / 2
    assert numbers(row(out, "TTFT"))[1] == round(p50 * 1e3, 1)
    assert "warm-up" in out


def test_run_two_tenants_summary_matches_the_engine(engines, capsys):
    assert cli.main(["run", "--workload", "two_tenants", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    (engine,) = engines
    check_summary_against_engine(out, engine)
    assert row(out, "requests").startswith("6 finished")
    # each tenant's first request misses although the other tenant has the document cached
    firsts = {}
    for r in engine.requests.values():
        firsts.setdefault(r.cache_salt, r)
    assert [r.metrics.cached_tokens for r in firsts.values()] == [0, 0]
    assert numbers(row(out, "request hit rate"))[1:] == [4, 6]
    assert err == ""


def test_run_eviction_pressure_on_a_small_pool_with_progress(engines, capsys, monkeypatch):
    monkeypatch.setattr(type(sys.stderr), "isatty", lambda self: True)  # as on a terminal
    argv = ["run", "--workload", "eviction_pressure.jsonl", "--num-blocks", "48",
            "--threads", "1"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    (engine,) = engines
    check_summary_against_engine(out, engine)
    assert engine.num_blocks == 48
    assert numbers(row(out, "evictions"))[0] > 0 and numbers(row(out, "preemptions"))[0] > 0
    assert "48 blocks x 16 tokens" in out
    assert err.count("\r") == 13 and "[" + "#" * 30 + "] 12/12 requests" in err
    assert err.endswith("\n")


def test_shipped_demo_workload_runs_headless(engines, capsys):
    assert cli.main(["run", "--workload", DEFAULT_WORKLOAD, "--no-progress"]) == 0
    out, _ = capsys.readouterr()
    (engine,) = engines
    assert "shared_system_prompt.jsonl: demo on cpu" in out
    check_summary_against_engine(out, engine)
    assert numbers(row(out, "request hit rate"))[1:] == [11, 12]


def test_bare_kvscope_opens_the_window_on_the_demo_model(monkeypatch):
    import kvscope.app.window.gui as gui

    opened = []
    monkeypatch.setattr(gui, "run_gui", lambda model: opened.append(model) or 0)
    assert cli.main([]) == 0
    assert cli.main(["gui", "--model", "/some/folder"]) == 0
    assert opened == ["demo", "/some/folder"]


def test_generate_prints_the_engines_text(engines, capsys):
    argv = ["generate", "The list", "--max-tokens", "12", "--ignore-eos", "--echo"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    (engine,) = engines
    (req,) = engine.requests.values()
    assert out == "The list" + req.text + "\n"
    assert req.params == SamplingParams(max_tokens=12, ignore_eos=True)
    assert err.startswith(f"[{req.metrics.prompt_tokens} prompt tokens (0 from the cache), "
                          "12 output tokens, finish: length")


def test_generate_several_samples(engines, capsys):
    argv = ["generate", "A", "B", "-n", "2", "--temperature", "0.8", "--seed", "1",
            "--max-tokens", "3", "--stop", "zz"]
    assert cli.main(argv) == 0
    out, _ = capsys.readouterr()
    headers = [x for x in out.splitlines() if x.startswith("---")]
    assert headers == ["--- prompt 1, sample 1 ---", "--- prompt 1, sample 2 ---",
                       "--- prompt 2, sample 1 ---", "--- prompt 2, sample 2 ---"]
    assert engines[0].requests[0].params.stop == ["zz"]


def one_line_error(capsys, argv) -> str:
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("kvscope: error: ") and err.count("\n") == 1
    assert "Traceback" not in err
    return err


def test_broken_model_folder_exits_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    err = one_line_error(capsys, ["run", "--model", str(tmp_path), "--workload", "two_tenants"])
    assert f"cannot load model {str(tmp_path)!r}" in err and "config.json" in err
    err = one_line_error(capsys, ["generate", "--model", str(tmp_path / "nowhere"), "hi"])
    assert "model folder not found" in err


def test_bad_workload_line_exits_2_naming_the_line(tmp_path, capsys, engines):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a"}) + "\n\n" + json.dumps({"promt": "b"}) + "\n")
    err = one_line_error(capsys, ["run", "--workload", str(bad)])
    assert "bad.jsonl:3: unknown key 'promt'" in err
    assert engines == []  # the workload is checked before the model is loaded
    err = one_line_error(capsys, ["run", "--workload", str(tmp_path / "missing.jsonl")])
    assert "workload not found" in err and "two_tenants" in err


def test_other_user_errors_exit_2(capsys):
    if not torch.cuda.is_available():
        err = one_line_error(capsys, ["generate", "--device", "cuda", "hi"])
        assert "CUDA is not available" in err
    err = one_line_error(capsys, ["generate", "--top-p", "0", "hi"])
    assert "--top-p" in err
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--workload", "two_tenants", "--num-blocks", "0"])
    assert info.value.code == 2
    assert "must be at least 1" in capsys.readouterr().err


def test_prompt_rejected_by_the_engine_exits_2(capsys):
    err = one_line_error(capsys, ["generate", "--num-blocks", "2", "--max-tokens", "64", "hi"])
    assert "prompt 1 rejected" in err and "the KV pool has only 2" in err


def test_run_records_and_export_writes_a_trace_and_csv(tmp_path, capsys):
    session = tmp_path / "run.kvscope"
    assert cli.main(["run", "--workload", "two_tenants", "--no-progress", "--record",
                     str(session), "--threads", "1"]) == 0
    out, _ = capsys.readouterr()
    assert f"to {session}" in out
    trace, csv_dir = tmp_path / "t.json", tmp_path / "csv"
    assert cli.main(["export", str(session), "--chrome-trace", str(trace), "--csv",
                     str(csv_dir)]) == 0
    assert json.loads(trace.read_text())["traceEvents"]
    assert (csv_dir / "requests.csv").read_text().count("\n") > 1
    assert cli.main(["run", "--workload", "two_tenants", "--record-text"]) == 2


def test_replay_of_a_bad_file_exits_2_before_any_window(tmp_path, capsys):
    bad = tmp_path / "bad.kvscope"
    bad.write_bytes(b"\0" * 4096)
    assert cli.main(["replay", str(bad)]) == 2
    assert "kvscope: error:" in capsys.readouterr().err


def test_prepack_cpu_weights_reaches_the_engine(engines, capsys):
    prompt = "The list of the words in the sentence is longer than twelve tokens. " * 2
    assert cli.main(["generate", prompt, "--max-tokens", "4", "--prepack-cpu-weights"]) == 0
    (engine,) = engines
    assert engine.config.prepack_cpu_weights
    assert engine.runner.prepacked_weight_bytes > 0  # the prompt's prefill made the copies
