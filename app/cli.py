"""The `kvscope` command line.

    kvscope run --workload FILE [--model demo] [engine options]   # headless, prints a summary
    kvscope generate [--model demo] "prompt" [sampling options]   # prints the generated text
    kvscope gui [--model demo]                                      # the desktop application
    kvscope                                                         # the same: default_action()

Errors a user can cause (a model that does not load, a bad workload line, a bad option value)
print one line to stderr and exit with status 2. No Qt here: the GUI is imported lazily.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.resources
import os
import re
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from kvscope.app import cli_attach, cli_experiment, cli_lab, cli_serve
from kvscope.app.engine_host import cpu_cores, set_engine_threads
from kvscope.engine import policies
from kvscope.engine.config import DEFAULT_CPU_BLOCKS, check_text
from kvscope.lab.workload import WorkloadError, load_workload
from kvscope.lab.workload_run import RunSummary, WorkloadRunner, summarize

DEFAULT_MODEL = "demo"
DEFAULT_WORKLOAD = "shared_system_prompt"
KV_DTYPES = ("auto", "float16", "bfloat16", "float32", "fp8")


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def default_action() -> int:
    """What a bare `kvscope` does: open the window on the demo model, the demo workload one
    key (F5) away."""
    return main(["gui"])


def cmd_gui(args: argparse.Namespace) -> int:
    from kvscope.app.gui import run_gui  # Qt is imported only here

    return run_gui(args.model)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        return default_action()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CliError as e:
        print(f"kvscope: error: {e}", file=sys.stderr)
        return 2
    except WorkloadError as e:
        print(f"kvscope: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # e.g. Ctrl+C while the model loads: one line, no traceback
        print("kvscope: interrupted", file=sys.stderr)
        return 130


# ------------------------------------------------------------------------------------ parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvscope", description="A KV-cache inspector with a real paged-KV inference engine. "
        "Without a command: open the desktop application on the demo model.")
    parser.add_argument("--version", action="version", version=f"kvscope {_version()}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")

    gui = sub.add_parser("gui", help="open the desktop application (the default)",
                         description="Open the kvscope window with a model loaded.")
    gui.add_argument("--model", default=DEFAULT_MODEL,
                     help="demo, smollm2, a local model folder, a .gguf file, or a repo id in the "
                     "local HF cache")
    gui.set_defaults(func=cmd_gui)

    run = sub.add_parser("run", help="run a workload headless and print a summary",
                         description="Run a workload file (JSON Lines; see "
                         "resources/workloads/README.md) and print TTFT, TPOT, throughput, "
                         "hit rates, evictions and preemptions.",
                         epilog="Exit status: 0 when the run completed (rejected requests, if "
                         "any, are listed with their reasons on stderr); 2 for a bad option, "
                         "workload or model, and when the engine rejected every request (so "
                         "nothing ran); 130 when interrupted.")
    run.add_argument("--workload", required=True, metavar="FILE",
                     help="a workload file, or the name of a shipped one: "
                     + ", ".join(shipped_workloads()))
    run.add_argument("--no-progress", action="store_true",
                     help="no progress bar (drawn on stderr only when it is a terminal)")
    run.add_argument("--record", metavar="FILE", default=None,
                     help="record the session to FILE (.kvscope) for replay and export")
    run.add_argument("--record-text", action="store_true",
                     help="with --record: also store prompt and output text (default: token "
                     "counts and block hashes only)")
    run.add_argument("--record-raw-hashes", action="store_true",
                     help="with --record: store the engine's block hashes as they are (to compare "
                     "sessions or match an external engine); by default they are keyed per file, "
                     "so nobody can confirm a guessed prompt from them")
    run.add_argument("--overwrite", action="store_true", help="with --record: replace FILE")
    _engine_options(run)
    run.set_defaults(func=cmd_run)

    exp = sub.add_parser("export", help="export a recorded session (Perfetto trace, CSV)",
                         description="Export a .kvscope session: Chrome Trace Event JSON that "
                         "opens in ui.perfetto.dev, and/or requests.csv and steps.csv.")
    exp.add_argument("session", metavar="SESSION")
    exp.add_argument("--chrome-trace", metavar="OUT.json", default=None)
    exp.add_argument("--csv", metavar="DIR", default=None)
    exp.set_defaults(func=cmd_export)

    rep = sub.add_parser("replay", help="open a recorded session in the window",
                         description="Replay a .kvscope session in the desktop application: "
                         "the same panels, with a scrubber.")
    rep.add_argument("session", metavar="SESSION")
    rep.set_defaults(func=cmd_replay)

    gen = sub.add_parser("generate", help="generate text for one or more prompts",
                         description="Generate a completion for each prompt and print it.")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.add_argument("--max-tokens", type=_positive_int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="0: off")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("-n", type=_positive_int, default=1, help="samples per prompt")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop when this text appears (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--cache-salt", default=None)
    gen.add_argument("--echo", action="store_true", help="print the prompt before the output")
    _engine_options(gen)
    gen.set_defaults(func=cmd_generate)
    cli_lab.add_parser(sub)
    cli_attach.add_parser(sub)
    cli_serve.add_parser(sub)
    cli_experiment.add_parser(sub)
    return parser


def _engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="'demo', 'smollm2' (SmolLM2-135M-Instruct), a local Hugging Face model "
                   "folder, a .gguf file, or a repo id already in the local Hugging Face cache "
                   "(default: demo)")
    g.add_argument("--num-blocks", type=_positive_int, default=None,
                   help=f"KV pool size in blocks (default: {DEFAULT_CPU_BLOCKS} on the CPU, as "
                   "in the window; a share of free memory on CUDA)")
    g.add_argument("--block-size", type=_positive_int, default=16, help="tokens per block")
    g.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto",
                   help="KV cache dtype (auto: the model's)")
    g.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="model dtype (default: the checkpoint's; float32 on the CPU)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    g.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching")
    g.add_argument("--eviction-policy", choices=policies.names(), default="lru",
                   help="which cached block is reused first (default: lru, as vLLM)")
    g.add_argument("--no-kv-cache", action="store_true",
                   help="the naive loop: recompute every sequence at every step")
    g.add_argument("--max-batched-tokens", type=_positive_int, default=1024,
                   help="token budget per step (default 1024)")
    g.add_argument("--max-num-seqs", type=_positive_int, default=64,
                   help="running requests at most (default 64)")
    g.add_argument("--prepack-cpu-weights", action="store_true",
                   help="CPU prefill on oneDNN with a reordered copy of each weight: faster "
                   "prefill, about 0.8x the weights in extra memory")
    g.add_argument("--threads", type=_positive_int, default=None,
                   help=f"torch CPU threads, 1 to the {cpu_cores()} CPUs this process may use "
                   "(default: all but one, or OMP_NUM_THREADS if set)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvscope")
    except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "unknown"


# ------------------------------------------------------------------------------- workloads
def _workloads_dir() -> Path:
    return Path(os.fspath(importlib.resources.files("kvscope.resources") / "workloads"))


def shipped_workloads() -> list[str]:
    return sorted(p.stem for p in _workloads_dir().glob("*.jsonl"))


def resolve_workload(name: str) -> Path:
    """A path to a workload file, or the name of a shipped workload (with or without .jsonl)."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    stem = name[:-len(".jsonl")] if name.endswith(".jsonl") else name
    if os.sep not in name and stem in shipped_workloads():
        return _workloads_dir() / f"{stem}.jsonl"
    raise CliError(f"workload not found: {name} (shipped workloads: "
                   f"{', '.join(shipped_workloads())})")


# ---------------------------------------------------------------------------------- engine
def load_engine(args: argparse.Namespace):
    """Build the engine the options describe; user errors become CliError."""
    import torch

    from kvscope.engine import Engine, EngineConfig
    from kvscope.engine.models.load import ModelLoadError

    if args.threads is not None and args.threads > cpu_cores():
        raise CliError(f"--threads {args.threads}: this process may use {cpu_cores()} CPUs; "
                       f"give 1 to {cpu_cores()}")
    set_engine_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: CUDA is not available (this torch build: "
                       f"{torch.__version__})")
    try:
        config = EngineConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                              kv_cache_dtype=args.kv_dtype, device=args.device, dtype=args.dtype,
                              enable_prefix_caching=not args.no_prefix_cache,
                              enable_kv_cache=not args.no_kv_cache,
                              max_num_batched_tokens=args.max_batched_tokens,
                              max_num_seqs=args.max_num_seqs,
                              eviction_policy=args.eviction_policy,
                              prepack_cpu_weights=args.prepack_cpu_weights)
        return Engine.from_pretrained(args.model, config)
    except ModelLoadError as e:
        raise CliError(f"cannot load model {args.model!r}: {e}") from None
    except ValueError as e:
        raise CliError(str(e).splitlines()[0] if str(e) else repr(e)) from None


def describe_engine(engine, model: str) -> str:
    c = engine.config
    mode = ("no KV cache (naive loop)" if not c.enable_kv_cache else
            "prefix cache " + ("on" if c.enable_prefix_caching else "off"))
    return (f"{model} on {c.device}, {engine.num_blocks} blocks x {c.block_size} tokens, "
            f"KV {engine.runner.cache_dtype}, {mode}".replace("torch.", ""))


# -------------------------------------------------------------------------------- commands
@contextlib.contextmanager
def _signals(names: tuple[str, ...], handler):
    """`handler` for these signals (those the platform has) inside the block; the main thread
    only, where Python runs signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {n: signal.signal(getattr(signal, n), handler) for n in names if hasattr(signal, n)}
    try:
        yield
    finally:
        for n, previous in old.items():
            signal.signal(getattr(signal, n), previous)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _term_interrupts():
    """SIGTERM and SIGHUP stop a run as Ctrl+C does (the recording is finished, not cut)."""
    return _signals(("SIGTERM", "SIGHUP"), _raise_interrupt)


def _between_steps(stop: threading.Event):
    """While a run steps the engine, Ctrl+C, SIGTERM and SIGHUP set `stop`, checked between
    steps, instead of raising wherever the main thread is: an exception inside a step could cut
    it in half, or land after the engine counted it and before the recorder got it (a recording
    with a gap in its steps). A second signal raises at once (a step that never ends)."""
    def interrupt(signum, frame):
        if stop.is_set():
            _raise_interrupt(signum, frame)
        stop.set()

    return _signals(("SIGINT", "SIGTERM", "SIGHUP"), interrupt)


def run_until_signal(runner: WorkloadRunner) -> bool:
    """Run the workload to its end, or until Ctrl+C, SIGTERM or SIGHUP (taken between steps,
    see `_between_steps`; then everything in flight is cancelled). True if interrupted."""
    stop = threading.Event()
    runner.sleep = stop.wait  # an idle wait for the next arrival ends at once on a signal
    with _between_steps(stop):
        while not stop.is_set() and (wait := runner.advance()) is not None:
            if wait > 0:
                runner.sleep(wait)
    if stop.is_set():
        runner.stop()
    return stop.is_set()


@_term_interrupts()
def cmd_run(args: argparse.Namespace) -> int:
    if args.record_text and not args.record:
        raise CliError("--record-text needs --record FILE")
    if args.record_raw_hashes and not args.record:
        raise CliError("--record-raw-hashes needs --record FILE")
    path = resolve_workload(args.workload)
    workload = load_workload(path)  # before the model: a bad line fails fast
    if args.record:
        check_record_path(Path(args.record), args.overwrite)
    engine = load_engine(args)
    recorder = status = None
    if args.record:
        from kvscope.sessions import Recorder

        try:
            recorder = Recorder(args.record, engine, record_text=args.record_text,
                                overwrite=args.overwrite,
                                raw_hashes=args.record_raw_hashes).start()
        except (OSError, ValueError) as e:
            raise CliError(f"--record: {e}") from None
    # \r redraws only on a terminal: in a log or a pipe they would pile up as garbage
    show = not args.no_progress and sys.stderr.isatty()
    bar = ProgressBar(sys.stderr, label=path.stem) if show else None
    runner = WorkloadRunner(engine, workload, on_progress=bar.update if bar else None)
    try:
        interrupted = run_until_signal(runner)
        result = runner.result
    finally:
        if bar:
            bar.close()
        if recorder is not None:
            status = recorder.close()
    print(f"kvscope run: {path.name}: {describe_engine(engine, args.model)}")
    print(format_summary(summarize(engine, result)))
    if status is not None:
        print(f"recorded {status.steps_written} steps, {status.events_written} events to "
              f"{args.record}" + (f" (the recorder stopped early: {status.error})"
                                  if status.error else ""))
    if interrupted:
        print("interrupted: unfinished requests were cancelled")
        return 130
    return report_rejections([line.outputs[0] for line in result.lines if line.outputs])


def report_rejections(outputs) -> int:
    """Each distinct rejection reason with its count on stderr; 2 when every request was
    rejected (nothing ran), else 0. `outputs`: one per submitted workload line (its first
    sample)."""
    reasons = Counter(o.error or "no reason given" for o in outputs
                      if o.finish_reason == "rejected")
    if not reasons:
        return 0
    total = sum(reasons.values())
    nothing_ran = total == len(outputs)
    head = (f"kvscope: error: all {total} requests were rejected" if nothing_ran
            else f"kvscope: {total} of {len(outputs)} requests were rejected")
    if len(reasons) == 1:
        print(f"{head}: {next(iter(reasons))}", file=sys.stderr)
    else:
        print(f"{head}:", file=sys.stderr)
        for reason, count in reasons.most_common(5):
            print(f"  {count} x {reason}", file=sys.stderr)
        if len(reasons) > 5:
            print(f"  ... and {len(reasons) - 5} other reasons", file=sys.stderr)
    return 2 if nothing_ran else 0


def check_record_path(path: Path, overwrite: bool) -> None:
    """Refuse a --record path that cannot be written, before the model is loaded: create the
    file (or open an existing one for writing) and remove what was created."""
    if path.is_dir():
        raise CliError(f"--record: {path} is a folder; give a file name")
    if path.exists():
        if not overwrite:
            raise CliError(f"--record: {path} exists (pass --overwrite to replace it)")
        try:
            open(path, "r+b").close()  # noqa: SIM115 - only checks the file can be written
        except OSError as e:
            raise CliError(f"--record: cannot write {path}: {e.strerror}") from None
        return
    folder = path.parent
    if not folder.is_dir():
        raise CliError(f"--record: the folder {folder} does not exist")
    try:
        open(path, "xb").close()  # noqa: SIM115
    except OSError as e:
        raise CliError(f"--record: cannot create {path}: {e.strerror}") from None
    path.unlink()


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


def _option_names(message: str) -> str:
    """'SamplingParams.top_p must ...' -> '--top-p must ...': name the option the user typed."""
    return re.sub(r"SamplingParams\.(\w+)",
                  lambda m: "-n" if m[1] == "n" else "--" + m[1].replace("_", "-"), message)


def cmd_replay(args: argparse.Namespace) -> int:
    from kvscope.sessions import SessionError, SessionReader

    try:  # a bad file is reported here, before any window opens
        with SessionReader(args.session) as reader:
            reader.requests()  # the rows the window decodes first
            reader.steps()
    except SessionError as e:
        raise CliError(str(e)) from None
    from kvscope.app.gui import run_gui

    return run_gui(session=args.session)


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
    engine = load_engine(args)
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
              f"TTFT {_ms(m.ttft_s)}, TPOT {_ms(m.tpot_s)}]", file=sys.stderr)
    return status


# ---------------------------------------------------------------------------------- output
class ProgressBar:
    """`label [#####.....] 5/12 requests  3.2 s` on one line, redrawn with a carriage return."""

    def __init__(self, stream, label: str = "", width: int = 30):
        self.stream, self.label, self.width = stream, label, width
        self.t0 = time.monotonic()
        self.drawn = False

    def update(self, done: int, total: int) -> None:
        filled = self.width * done // total if total else self.width
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {done}/{total} requests "
                          f"{time.monotonic() - self.t0:5.1f} s")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _pct(rate: float) -> str:
    return f"{100 * rate:.1f} %"


def format_summary(s: RunSummary) -> str:
    requests = (f"{s.num_finished} finished, {s.num_rejected} rejected, "
                f"{s.num_cancelled} cancelled")
    if s.num_requests != s.num_lines:
        requests += f" ({s.num_lines} workload lines)"
    if s.num_skipped:
        requests += f"; {s.num_skipped} skipped"
    rows = [
        ("requests", requests),
        ("TTFT", f"p50 {_ms(s.ttft_p50_s)}   p99 {_ms(s.ttft_p99_s)}"),
        ("TPOT", f"p50 {_ms(s.tpot_p50_s)}   p99 {_ms(s.tpot_p99_s)}"),
        ("throughput", f"{s.output_tokens_per_s:.1f} output tokens/s, "
                       f"{s.total_tokens_per_s:.1f} total tokens/s (prompt + output)"),
        ("token hit rate", f"{_pct(s.token_hit_rate)} ({s.hit_tokens} of {s.query_tokens} "
                           "prompt tokens served from the cache)"),
        ("request hit rate", f"{_pct(s.request_hit_rate)} ({s.num_requests_hit} of "
                             f"{s.num_requests_queried} requests reused a cached block)"),
        ("evictions", f"{s.num_evictions} blocks"),
        ("preemptions", f"{s.num_preemptions}"),
        ("tokens", f"{s.prompt_tokens} prompt, {s.output_tokens} output"),
        ("steps", f"{s.num_steps} in {s.duration_s:.2f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"  {name:<{width}}  {value}" for name, value in rows]
    if s.num_warmup_steps:
        lines.append(f"  note: the first {s.num_warmup_steps} steps (warm-up, "
                     f"{s.warmup_s:.2f} s) are left out of the throughput; TTFT and TPOT "
                     "include them")
    else:
        lines.append("  note: no warm-up steps in this run's throughput window (a warm engine, "
                     "or a run too short to leave them out)")
    return "\n".join(lines)
