"""What the `kvscope` subcommands share: the user-error type, the engine options and the engine
they build, workload names, the --record path check, signal handling between engine steps, and
the progress bar. No Qt here.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.resources
import os
import signal
import sys
import threading
import time
from pathlib import Path

from kvscope.app.host.server import cpu_cores, set_engine_threads
from kvscope.engine import policies
from kvscope.engine.config import DEFAULT_CPU_BLOCKS, KV_CACHE_DTYPES
from kvscope.lab.workload_run import WorkloadRunner

DEFAULT_MODEL = "demo"
DEFAULT_WORKLOAD = "shared_system_prompt"


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def kv_scales(text: str) -> float | str:
    """--kv-scales: "calibrate" or a positive finite number."""
    if text == "calibrate":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'calibrate' or a number, not {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def positive_int(text: str) -> int:
    """An option's whole number of at least 1; digit groups may be marked ("20_000", "20,000")."""
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def host_size(text: str) -> tuple[int, int]:
    """--host-blocks: (blocks, 0) or (0, bytes) (lab.tiers.host_size)."""
    from kvscope.lab import tiers

    try:
        return tiers.host_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="'demo', 'demo-hybrid' (the demo with a 128-token sliding window on half "
                   "its layers), 'smollm2' (SmolLM2-135M-Instruct), a local Hugging Face model "
                   "folder, a .gguf file, or a repo id already in the local Hugging Face cache "
                   "(default: demo)")
    g.add_argument("--num-blocks", type=positive_int, default=None,
                   help=f"KV pool size in blocks (default: {DEFAULT_CPU_BLOCKS} on the CPU, as "
                   "in the window; a share of free memory on CUDA)")
    g.add_argument("--block-size", type=positive_int, default=16, help="tokens per block")
    g.add_argument("--kv-cache-dtype", "--kv-dtype", dest="kv_dtype", choices=KV_CACHE_DTYPES,
                   default="auto", help="KV cache format (auto: the model's dtype; fp8, "
                   "fp8_per_head, int8/int4_per_token_head, kivi4/kivi2: quantized)")
    g.add_argument("--kv-scales", type=kv_scales, default=1.0, metavar="calibrate|S",
                   help="fp8 caches: every K and V scale S (default 1.0), or 'calibrate' from "
                   "the first forward pass's prompts (per layer; per head with fp8_per_head)")
    g.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="model dtype (default: the checkpoint's; float32 on the CPU)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    g.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching")
    g.add_argument("--eviction-policy", choices=policies.names(timed=False), default="lru",
                   help="which cached block is reused first (default: lru, as vLLM)")
    g.add_argument("--no-kv-cache", action="store_true",
                   help="the naive loop: recompute every sequence at every step")
    g.add_argument("--max-batched-tokens", type=positive_int, default=1024,
                   help="token budget per step (default 1024)")
    g.add_argument("--max-num-seqs", type=positive_int, default=64,
                   help="running requests at most (default 64)")
    g.add_argument("--host-blocks", type=host_size, default=(0, 0), metavar="N|SIZE",
                   help="a host tier behind the pool: N blocks, or a size such as 2GiB or "
                   "512MiB (blocks of the model's KV that fit). Evicted blocks are copied there "
                   "and prefix hits found there are loaded back (default: none)")
    g.add_argument("--host-eviction-policy", choices=policies.names(timed=False),
                   default="lru",
                   help="which host block is reused first (default: lru)")
    g.add_argument("--prepack-cpu-weights", action="store_true",
                   help="CPU prefill on oneDNN with a reordered copy of each weight: faster "
                   "prefill, about 0.8x the weights in extra memory")
    g.add_argument("--threads", type=positive_int, default=None,
                   help=f"torch CPU threads, 1 to the {cpu_cores()} CPUs this process may use "
                   "(default: all but one, or OMP_NUM_THREADS if set)")


# ------------------------------------------------------------------------------- workloads
def workloads_dir() -> Path:
    return Path(os.fspath(importlib.resources.files("kvscope.resources") / "workloads"))


def shipped_workloads() -> list[str]:
    return sorted(p.stem for p in workloads_dir().glob("*.jsonl"))


def resolve_workload(name: str) -> Path:
    """A path to a workload file, or the name of a shipped workload (with or without .jsonl)."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    stem = name[:-len(".jsonl")] if name.endswith(".jsonl") else name
    if os.sep not in name and stem in shipped_workloads():
        return workloads_dir() / f"{stem}.jsonl"
    raise CliError(f"workload not found: {name} (shipped workloads: "
                   f"{', '.join(shipped_workloads())})")


# ---------------------------------------------------------------------------------- engine
def load_engine(args: argparse.Namespace):
    """Build the engine the options describe; user errors become CliError. Ctrl+C while it loads
    raises KeyboardInterrupt, also when a library swallowed the first one."""
    with _interrupt_kept():
        return _load_engine(args)


def _load_engine(args: argparse.Namespace):
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
                              kv_cache_dtype=args.kv_dtype, kv_scales=args.kv_scales,
                              device=args.device, dtype=args.dtype,
                              enable_prefix_caching=not args.no_prefix_cache,
                              enable_kv_cache=not args.no_kv_cache,
                              max_num_batched_tokens=args.max_batched_tokens,
                              max_num_seqs=args.max_num_seqs,
                              eviction_policy=args.eviction_policy,
                              prepack_cpu_weights=args.prepack_cpu_weights,
                              host_blocks=args.host_blocks[0], host_bytes=args.host_blocks[1],
                              host_eviction_policy=args.host_eviction_policy)
        return Engine.from_pretrained(args.model, config)
    except ModelLoadError as e:
        raise CliError(f"cannot load model {args.model!r}: {e}") from None
    except ValueError as e:
        raise CliError(str(e).splitlines()[0] if str(e) else repr(e)) from None


def describe_engine(engine, model: str) -> str:
    c = engine.config
    mode = ("no KV cache (naive loop)" if not c.enable_kv_cache else
            "prefix cache " + ("on" if c.enable_prefix_caching else "off"))
    tier = f", host tier {engine.num_host_blocks} blocks" if engine.num_host_blocks else ""
    fmt = engine.runner.format
    kv = engine.runner.cache_dtype if fmt.is_default else fmt.name
    return (f"{model} on {c.device}, {engine.num_blocks} blocks x {c.block_size} tokens{tier}, "
            f"KV {kv}, {mode}".replace("torch.", ""))


# ------------------------------------------------------------------------------- recording
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


# --------------------------------------------------------------------------------- signals
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


@contextlib.contextmanager
def _interrupt_kept():
    """Ctrl+C raises KeyboardInterrupt as usual and is also noted: one raised where Python drops
    it (inside a __del__, a weakref or GC callback: printed as "Exception ignored", seen under
    load while torch imports) is raised again when the block ends, instead of the run going on."""
    got: list[int] = []

    def interrupt(signum, frame):
        got.append(signum)
        _raise_interrupt(signum, frame)

    with _signals(("SIGINT",), interrupt):
        yield
    if got:
        raise KeyboardInterrupt(signal.Signals(got[0]).name)


def term_interrupts():
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


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def pct(rate: float) -> str:
    return f"{100 * rate:.1f} %"


def listen_headless(session, duration_s: float) -> None:
    """Run an attached session for duration_s seconds (Ctrl+C ends it early); say its
    problems."""
    try:
        session.run(duration_s)
    except KeyboardInterrupt:
        print("interrupted")
    finally:
        session.close()
    for problem in session.take_problems():
        print(f"kvscope: {problem}", file=sys.stderr)
