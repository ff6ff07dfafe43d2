"""`kvscope serve`: run a workload on our engine and publish its KV-cache events in vLLM's format,
so that `kvscope attach` (or any vLLM KV-event consumer) can be tried against it.

    kvscope serve --kv-events tcp://*:5557 [--kv-events-replay tcp://*:5558] [--workload W]
"""

from __future__ import annotations

import argparse
import time

from kvscope.app.cli.common import DEFAULT_WORKLOAD, add_engine_options, positive_int


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="run a workload and publish its KV events (vLLM format)",
                       description="Run a workload on the engine while publishing its prefix "
                       "cache as vLLM KV events (BlockStored / BlockRemoved / AllBlocksCleared; "
                       "no token ids) on a ZMQ PUB socket.")
    p.add_argument("--kv-events", required=True, metavar="ENDPOINT",
                   help="where to publish, e.g. tcp://*:5557 (bound when it has * or ::, "
                   "connected to otherwise, as vLLM does)")
    p.add_argument("--kv-events-replay", metavar="ENDPOINT", default=None,
                   help="a replay endpoint, e.g. tcp://*:5558 (the last 10,000 batches)")
    p.add_argument("--topic", default="")
    p.add_argument("--workload", default=DEFAULT_WORKLOAD, metavar="FILE")
    p.add_argument("--wait", type=positive_int, default=2, metavar="S",
                   help="seconds to wait for subscribers before the run, and for replay "
                   "requests after it (default 2)")
    add_engine_options(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import zmq

    from kvscope.app.cli import common
    from kvscope.app.cli.common import CliError, describe_engine, resolve_workload, run_until_signal
    from kvscope.app.cli.run import format_summary
    from kvscope.lab.workload import load_workload
    from kvscope.lab.workload_run import WorkloadRunner, summarize
    from kvscope.sessions.kv_events import KVEventPublisher
    from kvscope.sessions.kv_events.fleet import snapshot_digest

    workload = load_workload(resolve_workload(args.workload))
    engine = common.load_engine(args)
    try:
        pub = KVEventPublisher(engine, args.kv_events, args.kv_events_replay, args.topic)
    except zmq.ZMQError as e:
        raise CliError(f"--kv-events: cannot open {args.kv_events}: {e}") from None
    print(f"kvscope serve: {describe_engine(engine, args.model)}")
    print(f"publishing KV events on {pub.endpoint}"
          + (f", replay on {pub.replay_endpoint}" if pub.replay_endpoint else ""), flush=True)
    try:
        time.sleep(args.wait)
        runner = WorkloadRunner(engine, workload)
        interrupted = run_until_signal(runner)  # a step is published whole, or not at all
        print(format_summary(summarize(engine, runner.result)))
        print(f"published {pub.seq} batches, {pub.num_blocks_published} block events",
              flush=True)
        print(f"cache at the end: {snapshot_digest(engine.snapshot())}", flush=True)
        if interrupted:
            print("interrupted: unfinished requests were cancelled")
            return 130
        time.sleep(args.wait)
    finally:
        pub.close()
    return 0
