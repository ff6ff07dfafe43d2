"""`kvscope gui` and `kvscope replay`: the desktop application (Qt is imported only when one
of them runs)."""

from __future__ import annotations

import argparse

from kvscope.app.cli.common import DEFAULT_MODEL, CliError


def add_parser(sub) -> None:
    gui = sub.add_parser("gui", help="open the desktop application (the default)",
                         description="Open the kvscope window with a model loaded.")
    gui.add_argument("--model", default=DEFAULT_MODEL,
                     help="demo, smollm2, a local model folder, a .gguf file, or a repo id in the "
                     "local HF cache")
    gui.set_defaults(func=cmd_gui)

    rep = sub.add_parser("replay", help="open a recorded session in the window",
                         description="Replay a .kvscope session in the desktop application: "
                         "the same panels, with a scrubber.")
    rep.add_argument("session", metavar="SESSION")
    rep.set_defaults(func=cmd_replay)



def cmd_gui(args: argparse.Namespace) -> int:
    from kvscope.app.window.gui import run_gui  # Qt is imported only here

    return run_gui(args.model)


def cmd_replay(args: argparse.Namespace) -> int:
    from kvscope.sessions import SessionError, SessionReader

    try:  # a bad file is reported here, before any window opens
        with SessionReader(args.session) as reader:
            reader.requests()  # the rows the window decodes first
            reader.steps()
    except SessionError as e:
        raise CliError(str(e)) from None
    from kvscope.app.window.gui import run_gui

    return run_gui(session=args.session)
