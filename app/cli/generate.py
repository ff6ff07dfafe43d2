"""`kvscope generate`: a completion for each prompt, printed."""

from __future__ import annotations

import argparse
import re
import sys

from kvscope.app.cli import common
from kvscope.app.cli.common import CliError, add_engine_options, ms, positive_int
from kvscope.engine.config import check_text


def add_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate text for one or more prompts",
                         description="Generate a completion for each prompt and print it.")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.add_argument("--max-tokens", type=positive_int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="0: off")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("-n", type=positive_int, default=1, help="samples per prompt")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop when this text appears (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--cache-salt", default=None)
    gen.add_argument("--echo", action="store_true", help="print the prompt before the output")
    add_engine_options(gen)
    gen.set_defaults(func=cmd_generate)


def _option_names(message: str) -> str:
    """'SamplingParams.top_p must ...' -> '--top-p must ...': name the option the user typed."""
    return re.sub(r"SamplingParams\.(\w+)",
                  lambda m: "-n" if m[1] == "n" else "--" + m[1].replace("_", "-"), message)


def cmd_generate(args: argparse.Namespace) -> int:
    from kvscope.engine import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed, n=args.n,
                                stop=args.stop, ignore_eos=args.ignore_eos)
        for i, prompt in enumerate(args.prompts, 1):
            check_text(prompt, f"prompt {i}")
        if args.cache_salt is not None:
            check_text(args.cache_salt, "--cache-salt")
    except ValueError as e:
        raise CliError(_option_names(str(e))) from None
    engine = common.load_engine(args)
    if engine.tokenizer is None:
        raise CliError(f"model {args.model!r} has no tokenizer: cannot encode text prompts")
    outputs = engine.generate(args.prompts, params, cache_salt=args.cache_salt)
    roots = [o.request_id for o in outputs if o.parent_id is None]  # one per prompt, in order
    status = 0
    for out in outputs:
        index = roots.index(out.request_id if out.parent_id is None else out.parent_id)
        if out.finish_reason == "rejected":
            print(f"kvscope: error: prompt {index + 1} rejected: {out.error}", file=sys.stderr)
            status = 2
            continue
        if len(outputs) > 1:
            print(f"--- prompt {index + 1}, sample {out.sample_index + 1} ---")
        print((args.prompts[index] if args.echo else "") + out.text)
        m = out.metrics
        print(f"[{m.prompt_tokens} prompt tokens ({out.num_cached_tokens} from the cache), "
              f"{m.output_tokens} output tokens, finish: {out.finish_reason}, "
              f"TTFT {ms(m.ttft_s)}, TPOT {ms(m.tpot_s)}]", file=sys.stderr)
    return status
