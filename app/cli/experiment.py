"""`kvscope experiment NAME [--model M] [--csv OUT] [--png OUT]`: one of the textbook's KV-cache
claims measured on the loaded model; prints the claim, the table and a last line `verdict: ...`.
`kvscope experiment --list` lists them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvscope.lab.experiments import EXPERIMENTS, Cancelled, Control, Result


def add_parser(sub) -> None:
    p = sub.add_parser(
        "experiment", help="measure a textbook KV-cache claim on the loaded model",
        description="Measure one of the textbook's KV-cache claims on a real engine and print "
        "the table and a verdict. Names: " + ", ".join(EXPERIMENTS) + ".")
    p.add_argument("name", nargs="?", metavar="NAME", help="the experiment (see --list)")
    p.add_argument("--list", action="store_true", help="list the experiments and their claims")
    p.add_argument("--model", default="demo",
                   help="'demo', a local Hugging Face model folder, or a repo id already in the "
                   "local Hugging Face cache (default: demo)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds; for tests)")
    p.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                   help="kv-formats: measure on this workload (.jsonl) or session recorded with "
                   "its text (.kvscope) instead of the built-in passages")
    p.add_argument("--csv", type=Path, default=None, metavar="OUT.csv")
    p.add_argument("--png", type=Path, default=None, metavar="OUT.png")
    p.add_argument("--session", type=Path, default=None, metavar="FILE.kvscope",
                   help="also save the result in this session file (one being recorded too)")
    p.set_defaults(func=cmd_experiment)


def cmd_experiment(args: argparse.Namespace) -> int:
    from kvscope.engine.models.load import ModelLoadError
    from kvscope.sessions.errors import SessionError

    try:
        return _experiment(args)
    except (ValueError, OSError, ModelLoadError, SessionError) as e:
        print(f"kvscope: error: {e}", file=sys.stderr)
        return 2
    except (Cancelled, KeyboardInterrupt):
        print("kvscope experiment: cancelled", file=sys.stderr)
        return 130


def _experiment(args: argparse.Namespace) -> int:
    if args.list:
        for e in EXPERIMENTS.values():
            print(f"{e.name:<16} {e.claim}")
        return 0
    if args.name is None:
        raise ValueError("name an experiment (kvscope experiment --list shows them)")
    if args.name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {args.name!r}; one of: {', '.join(EXPERIMENTS)}")
    for out in (args.csv, args.png):
        if out is not None and not out.parent.is_dir():
            raise ValueError(f"{out}: folder {out.parent} does not exist")
    if args.prompts is not None:
        if args.name != "kv-formats":
            raise ValueError("--prompts applies to kv-formats only")
        if not args.prompts.is_file():
            raise ValueError(f"{args.prompts}: no such file")
    if args.session is not None:
        from kvscope.sessions import SessionReader

        SessionReader(args.session).close()  # refuse a missing or foreign file before running
    from kvscope.app.host.server import set_engine_threads
    from kvscope.lab.experiments import run

    set_engine_threads()
    print(f"{args.name}: {EXPERIMENTS[args.name].claim}", flush=True)
    prompts = None
    if args.prompts is not None:
        from kvscope.sessions.lab_input import experiment_prompts

        prompts = experiment_prompts(args.prompts)
    result = run(args.name, args.model, Control(progress=_progress), args.quick, args.device,
                 prompts)
    print(result.table())
    try:
        _save(args, result)
    finally:  # the verdict line is the last one, also when a file could not be written
        print(f"verdict: {result.verdict}")
    return 0


def _progress(fraction: float, _text: str) -> None:
    if sys.stderr.isatty():
        end = "\n" if fraction >= 1 else ""
        print(f"\r{100 * fraction:3.0f} %", end=end, file=sys.stderr, flush=True)


def _save(args: argparse.Namespace, result: Result) -> None:
    if args.csv:
        args.csv.write_text(result.to_csv(), encoding="utf-8")
        print(f"wrote {args.csv}")
    if args.png:
        from kvscope.app.plots.experiment import write_result_png  # Qt: only for a PNG

        write_result_png(args.png, result)
        print(f"wrote {args.png}")
    if args.session:
        from kvscope.sessions.experiments import save_experiment

        save_experiment(args.session, result)
        print(f"saved in {args.session}")
