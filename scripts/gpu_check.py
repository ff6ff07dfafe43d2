#!/usr/bin/env python3
"""GPU readiness check: proves the CUDA half of kvscope in one run of under five minutes.

    python3 scripts/gpu_check.py --out DIR [--quick] [--model HF_FOLDER]
    python3 scripts/gpu_check.py --cpu-dry-run --out DIR   # same code paths, tiny, on the CPU

1. triton kernels (KV store, paged prefill over a cached prefix, split-K decode) against the
   torch reference: GQA and MQA, head_dim 64/128, block 16, fp16/bf16/fp8 KV, contexts to 32k,
   batch 1..64, a cache past 2^31 elements, within the tolerances declared below;
2. engine greedy tokens against transformers (a random Llama with Llama 3.1 8B shapes, 2 layers,
   bfloat16; ``--model`` adds a real folder, e.g. SmolLM2);
3. decode kernel KV bandwidth (bytes read / kernel time from CUDA events) at 8k and 32k context,
   batch 1/16/64, against the nominal peak and a device-to-device copy measured in the same run;
4. no host synchronisation in a prefill and a decode forward (``torch.cuda.set_sync_debug_mode``)
   and engine step timing from CUDA events;
5. NVML read as the Device panel reads it (``kvscope.app.workers.nvml``);
6. the quantized KV formats (fp8_per_head, int8/int4_per_token_head, kivi4/kivi2) on the triton
   store and attention against the torch reference over prefill and decode passes (bytes
   stored, attention within the fp16 tolerance), and decode time per format against a float16
   cache at the bandwidth section's target context.
One table is printed and written to ``DIR/gpu_check.json``; the exit status is 1 if a check
failed. kvscope is imported from this source tree (no install; no Qt, psutil or sqlite-utils).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import types
from dataclasses import asdict
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_kvscope_from_source() -> None:
    """``kvscope.engine`` is ``ROOT/engine`` and so on (pyproject's package-dir): a ``kvscope``
    package whose search path is the repository root gives exactly that mapping."""
    package = types.ModuleType("kvscope")
    package.__path__ = [str(ROOT)]
    sys.modules["kvscope"] = package


# The bandwidth figure before the long kernel sweep, so a spent budget skips kernel cases rather
# than the figure; the engine section includes the sync checks.
SECTIONS = ("nvml", "bandwidth", "kernels", "engine", "formats")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="gpu_check_out", help="folder for gpu_check.json")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="the same code paths at tiny shapes on the CPU (triton interpreted)")
    p.add_argument("--quick", action="store_true", help="fewer and smaller GPU cases")
    p.add_argument("--model", help="also check greedy equivalence on this HF model folder")
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--budget-s", type=float, default=270.0,
                   help="stop starting new cases after this many seconds")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.model and not (Path(args.model) / "config.json").is_file():
        print(f"gpu_check: --model {args.model} is not a folder with config.json",
              file=sys.stderr)
        return 2
    if args.cpu_dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any triton kernel is decorated
    import_kvscope_from_source()
    import torch

    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; use --cpu-dry-run", file=sys.stderr)
        return 2
    from gpucheck import bandwidth, engine, formats, kernels, nvml
    from gpucheck.plan import Plan
    from gpucheck.report import Report

    started = time.monotonic()
    device = torch.device("cpu" if args.cpu_dry_run else "cuda")
    plan = Plan.make(args.cpu_dry_run, args.quick)
    report = Report(started + args.budget_s)
    checks = {"nvml": nvml.check_nvml, "bandwidth": bandwidth.check_bandwidth,
              "kernels": kernels.check_kernels,
              "engine": partial(engine.check_engine, model_folder=args.model),
              "formats": formats.check_formats}
    for name in SECTIONS:
        if name in args.only:
            report.run(name, checks[name], plan, device)
    print(report.table())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = _meta(args, device, time.monotonic() - started)
    meta["section_seconds"] = report.seconds
    (out / "gpu_check.json").write_text(json.dumps(
        {"meta": meta, "rows": [asdict(r) for r in report.rows], "errors": report.errors},
        indent=1, default=str))
    print(f"{'FAILED' if report.failed else 'passed'} in {meta['seconds']:.0f} s; "
          f"wrote {out / 'gpu_check.json'}")
    return 1 if report.failed else 0


def _meta(args, device, seconds: float) -> dict:
    import torch

    import kvscope.engine

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "transformers"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    return {"dry_run": args.cpu_dry_run, "quick": args.quick, "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "versions": versions, "kvscope_source": str(Path(kvscope.engine.__file__).parent),
            "seconds": round(seconds, 1)}


if __name__ == "__main__":
    sys.exit(main())
