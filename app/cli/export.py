"""`kvscope export`: a recorded session through one or more of the exporters (`EXPORTERS`)."""

from __future__ import annotations

import argparse

from kvscope.app.cli.common import CliError


def add_parser(sub) -> None:
    from kvscope.sessions.export import EXPORTERS

    exp = sub.add_parser("export", help="export a recorded session (Perfetto trace, CSV)",
                         description="Export a .kvscope session: " + "; ".join(
                             f"--{x.name}: {x.dialog_filter}" for x in EXPORTERS) + ".")
    exp.add_argument("session", metavar="SESSION")
    for x in EXPORTERS:
        exp.add_argument(f"--{x.name}", dest=x.dest, metavar=x.metavar, default=None,
                         help=x.dialog_filter)
    exp.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from kvscope.sessions import SessionError, SessionReader
    from kvscope.sessions.export import EXPORTERS, check_output, export_session

    chosen = [(x, getattr(args, x.dest)) for x in EXPORTERS if getattr(args, x.dest, None)]
    if not chosen:
        raise CliError("export: give " + " and/or ".join(f"--{x.name} {x.metavar}"
                                                         for x in EXPORTERS))
    try:
        for x, out in chosen:  # all of them before anything is written
            for path in x.outputs(out):
                check_output(args.session, path)
        with SessionReader(args.session) as reader:
            for x, out in chosen:
                for p in export_session(reader, x, out):
                    print(f"wrote {p}" + (f" {x.note}" if x.note else ""))
    except SessionError as e:
        raise CliError(str(e)) from None
    except (OSError, ValueError) as e:
        raise CliError(f"export: {e}") from None
    return 0
