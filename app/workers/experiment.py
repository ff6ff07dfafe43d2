"""The process that runs one experiment for the window (which never imports torch): JSON lines
on stdout, {"progress": f, "text": t} while it runs, then {"result": {...}} or {"error": "..."}.
The window cancels it by ending the process. No Qt here.

    python -m kvscope.app.workers.experiment NAME [--model M] [--quick] [--prompts FILE]
"""

from __future__ import annotations

import argparse
import json
import sys


def _emit(**message) -> None:
    print(json.dumps(message), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvscope-experiment-worker")
    p.add_argument("name")
    p.add_argument("--model", default="demo")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--prompts", default=None)
    args = p.parse_args(argv)
    from kvscope.app.host.server import set_engine_threads
    from kvscope.engine.models.load import ModelLoadError
    from kvscope.lab.experiments import Control, run
    from kvscope.sessions.errors import SessionError

    set_engine_threads()  # all cores but the window's one
    try:
        prompts = args.prompts
        if prompts is not None:
            from kvscope.sessions.lab_input import experiment_prompts

            prompts = experiment_prompts(prompts)
        result = run(args.name, args.model,
                     Control(progress=lambda f, text: _emit(progress=f, text=text)), args.quick,
                     prompts=prompts)
    except (ValueError, OSError, ModelLoadError, SessionError) as e:
        _emit(error=str(e))
        return 2
    _emit(result=result.to_dict())
    return 0


if __name__ == "__main__":
    sys.exit(main())
