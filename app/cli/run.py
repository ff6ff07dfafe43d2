"""`kvscope run`: a workload headless, a summary printed (and optionally recorded)."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from kvscope.app.cli import common
from kvscope.app.cli.common import (
    CliError,
    ProgressBar,
    add_engine_options,
    check_record_path,
    describe_engine,
    ms,
    pct,
    resolve_workload,
    run_until_signal,
    shipped_workloads,
    term_interrupts,
)
from kvscope.lab.tiers import blocks_text
from kvscope.lab.workload import load_workload
from kvscope.lab.workload_run import RunSummary, WorkloadRunner, summarize


def add_parser(sub) -> None:
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
    add_engine_options(run)
    run.set_defaults(func=cmd_run)



@term_interrupts()
def cmd_run(args: argparse.Namespace) -> int:
    if args.record_text and not args.record:
        raise CliError("--record-text needs --record FILE")
    if args.record_raw_hashes and not args.record:
        raise CliError("--record-raw-hashes needs --record FILE")
    path = resolve_workload(args.workload)
    workload = load_workload(path)  # before the model: a bad line fails fast
    if args.record:
        check_record_path(Path(args.record), args.overwrite)
    engine = common.load_engine(args)
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


def format_summary(s: RunSummary) -> str:
    requests = (f"{s.num_finished} finished, {s.num_rejected} rejected, "
                f"{s.num_cancelled} cancelled")
    if s.num_requests != s.num_lines:
        requests += f" ({s.num_lines} workload lines)"
    if s.num_skipped:
        requests += f"; {s.num_skipped} skipped"
    rows = [
        ("requests", requests),
        ("TTFT", f"p50 {ms(s.ttft_p50_s)}   p99 {ms(s.ttft_p99_s)}"),
        ("TPOT", f"p50 {ms(s.tpot_p50_s)}   p99 {ms(s.tpot_p99_s)}"),
        ("throughput", f"{s.output_tokens_per_s:.1f} output tokens/s, "
                       f"{s.total_tokens_per_s:.1f} total tokens/s (prompt + output)"),
        ("token hit rate", f"{pct(s.token_hit_rate)} ({s.hit_tokens} of {s.query_tokens} "
                           "prompt tokens served from the cache)"),
        ("request hit rate", f"{pct(s.request_hit_rate)} ({s.num_requests_hit} of "
                             f"{s.num_requests_queried} requests reused a cached block)"),
        ("evictions", f"{s.num_evictions} blocks"),
        *([("host tier", f"{s.host_hit_tokens} of the cached tokens loaded back from it; "
                         f"{blocks_text(s.offloaded_blocks, s.block_bytes)} copied there, "
                         f"{blocks_text(s.loaded_blocks, s.block_bytes)} back, "
                         f"in {ms(s.transfer_s)}")] if s.host_hit_tokens is not None else []),
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
