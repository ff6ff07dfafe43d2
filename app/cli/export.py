"""`kvscope export`: a recorded session as a Chrome trace (Perfetto) and/or CSV files."""

from __future__ import annotations

import argparse
import os

from kvscope.app.cli.common import CliError


def add_parser(sub) -> None:
    exp = sub.add_parser("export", help="export a recorded session (Perfetto trace, CSV)",
                         description="Export a .kvscope session: Chrome Trace Event JSON that "
                         "opens in ui.perfetto.dev, and/or requests.csv and steps.csv.")
    exp.add_argument("session", metavar="SESSION")
    exp.add_argument("--chrome-trace", metavar="OUT.json", default=None)
    exp.add_argument("--csv", metavar="DIR", default=None)
    exp.set_defaults(func=cmd_export)



def cmd_export(args: argparse.Namespace) -> int:
    from kvscope.sessions import SessionError, SessionReader, export_chrome_trace, export_csv
    from kvscope.sessions.export import check_output

    if not (args.chrome_trace or args.csv):
        raise CliError("export: give --chrome-trace OUT.json and/or --csv DIR")
    outputs = [args.chrome_trace] if args.chrome_trace else []
    if args.csv:
        outputs += [args.csv, *(os.path.join(args.csv, n) for n in ("requests.csv", "steps.csv"))]
    try:
        for out in outputs:  # all of them before anything is written
            check_output(args.session, out)
        with SessionReader(args.session) as reader:
            if args.chrome_trace:
                out = export_chrome_trace(reader, args.chrome_trace)
                print(f"wrote {out} (open it in https://ui.perfetto.dev)")
            if args.csv:
                for p in export_csv(reader, args.csv):
                    print(f"wrote {p}")
    except SessionError as e:
        raise CliError(str(e)) from None
    except (OSError, ValueError) as e:
        raise CliError(f"export: {e}") from None
    return 0
