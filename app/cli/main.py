"""The `kvscope` command line: one parser, one table of subcommands (`COMMANDS`: each module
adds its subparser with `add_parser(sub)`; a new subcommand is a module and a row).

    kvscope run --workload FILE [--model demo] [engine options]   # headless, prints a summary
    kvscope generate [--model demo] "prompt" [sampling options]   # prints the generated text
    kvscope gui [--model demo]                                      # the desktop application
    kvscope                                                         # the same: default_action()

Errors a user can cause (a model that does not load, a bad workload line, a bad option value)
print one line to stderr and exit with status 2. No Qt here: the GUI is imported lazily.
"""

from __future__ import annotations

import argparse
import sys

from kvscope.app.cli import attach, experiment, export, generate, lab, run, serve, window
from kvscope.app.cli.common import CliError
from kvscope.lab.workload import WorkloadError

COMMANDS = (window, run, export, generate, lab, attach, serve, experiment)


def default_action() -> int:
    """What a bare `kvscope` does: open the window on the demo model, the demo workload one
    key (F5) away."""
    return main(["gui"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        return default_action()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CliError, WorkloadError) as e:
        print(f"kvscope: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # e.g. Ctrl+C while the model loads: one line, no traceback
        print("kvscope: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvscope", description="A KV-cache inspector with a real paged-KV inference engine. "
        "Without a command: open the desktop application on the demo model.")
    parser.add_argument("--version", action="version", version=f"kvscope {_version()}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvscope")
    except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "unknown"
