"""scripts/gpu_check.py: its CPU dry run (the same code paths as on a GPU, tiny shapes, triton
interpreted) passes and writes the summary JSON, importing kvscope from the source tree with no
install and without Qt, psutil or sqlite-utils (none of which the GPU machine has)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"

# Imported at start-up by the child: hides the editable install and the packages the GPU
# machine lacks.
SITECUSTOMIZE = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
sys.path[:] = [p for p in sys.path if "__editable__" not in p]
sys.path_hooks[:] = [h for h in sys.path_hooks
                     if "__editable__" not in getattr(h, "__module__", "")]
sys.path_importer_cache.clear()
for name in ("PySide6", "pyqtgraph", "psutil", "sqlite_utils"):
    sys.modules[name] = None
"""


@pytest.fixture(scope="module")
def bare_env(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return env


def _run(args, env, cwd, timeout=300):
    return subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def test_the_bare_environment_has_no_kvscope_install(bare_env, tmp_path):
    probe = ("import importlib.util as u, sys; "
             "print(u.find_spec('kvscope'), 'psutil' in sys.modules)")
    out = _run(["-c", probe], bare_env, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "True"]


@pytest.mark.slow
def test_cpu_dry_run_passes_and_writes_the_table(bare_env, tmp_path):
    out = _run([str(SCRIPT), "--cpu-dry-run", "--out", str(tmp_path / "out")], bare_env, tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["meta"]["dry_run"] and report["errors"] == []
    assert Path(report["meta"]["kvscope_source"]) == ROOT / "engine"
    rows = report["rows"]
    by_section = {s: [r for r in rows if r["section"] == s]
                  for s in ("kernels", "engine", "sync", "bandwidth", "nvml", "formats")}
    assert all(by_section.values()), [s for s, r in by_section.items() if not r]
    kernels = by_section["kernels"]
    for kind in ("decode", "prefill", "store"):
        for dtype in ("fp16", "bf16", "fp8"):
            assert any(r["case"].startswith(kind) and f" {dtype} " in r["case"] for r in kernels)
    verdicts = [r for r in kernels if "cache elements" not in r["case"]] + by_section["engine"]
    verdicts += [r for r in by_section["formats"] if not r["case"].startswith("decode time")]
    for fmt in ("fp8_per_head", "int8_per_token_head", "int4_per_token_head", "kivi4", "kivi2"):
        for kind in ("attention", "store", "decode time"):
            assert any(r["case"].startswith(f"{kind} {fmt} ") for r in by_section["formats"])
    assert all(r["ok"] is True for r in verdicts)
    assert any(r["case"].startswith("int64 offsets: decode") for r in kernels)
    forwards = [r for r in by_section["sync"] if "forward" in r["case"]]
    assert len(forwards) == 2 and all(r["ok"] is True for r in forwards)
    # Nothing is measured on the CPU: no bandwidth verdict, no NVML failure.
    assert all(r["ok"] is None for r in by_section["bandwidth"] + by_section["nvml"])
    assert out.stdout.splitlines()[-1].startswith("passed in")


def test_bad_arguments_get_one_line_and_exit_2(bare_env, tmp_path):
    out = _run([str(SCRIPT), "--cpu-dry-run", "--model", str(tmp_path / "missing")], bare_env,
               tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "config.json" in out.stderr
    import torch

    if not torch.cuda.is_available():
        out = _run([str(SCRIPT)], bare_env, tmp_path)
        assert out.returncode == 2 and "--cpu-dry-run" in out.stderr


def test_greedy_comparison_tolerates_only_bf16_near_ties(monkeypatch):
    import torch

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    from gpucheck.engine import compare_greedy

    logits = [torch.tensor([4.0, 1.0, 0.0]), torch.tensor([2.0, 4.0, 4.0 - 2.0**-5])]
    assert compare_greedy([0, 1], [0, 1], logits) == (True, "equal")
    ok, text = compare_greedy([0, 2], [0, 1], logits)  # 1 bf16 step below the top
    assert ok and text.startswith("near-tie at token 1")
    ok, text = compare_greedy([1, 1], [0, 1], logits)  # 3.0 below the top
    assert not ok and text.startswith("DIFFERS at token 0")
