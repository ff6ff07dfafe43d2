"""`kvscope attach`: mirror a vLLM or SGLang server's prefix cache from its KV events.

    kvscope attach tcp://HOST:5557 [--replay tcp://HOST:5558] [--topic T] [--dp-ranks N]
    kvscope attach --endpoint NAME=tcp://HOST:5557[,REPLAY][,METRICS] ... | --fleet FILE
                   [--metrics http://HOST:8000/metrics] [--record FILE [--overwrite]]
                   [--slots N] [--headless --duration S]
                   [--hash-check sha256 [--hash-seed SEED] [--vllm-version X.Y[.Z]]
                                        [--lora-path NAME=PATH ...]]

Without --headless the window opens attached (File > Attach... does the same). Headless: listen
for S seconds, then print the mirror's summary, metrics and health. A bad address is an error
(exit 2); an endpoint that sends nothing, or sends something that is not KV events, is reported
at the end (exit 2 when nothing usable arrived) and never stops the listening early. --record
writes a .kvscope session (the hash slots, step by step) that replays like any other.

A fleet (--endpoint, repeatable, or --fleet FILE of `name endpoint [replay] [metrics]` lines):
each instance its own subscriber, health, metrics and hash parity, all in one window and one
recording (instances as ranks).
"""

from __future__ import annotations

import argparse
import sys

from kvscope.app.cli.common import listen_headless, positive_int


def add_parser(sub) -> None:
    p = sub.add_parser("attach", help="mirror a vLLM/SGLang server's KV cache from its events",
                       description="Subscribe to a vLLM or SGLang server's KV-cache events "
                       "(--kv-events-config with publisher zmq) and rebuild its prefix cache.")
    p.add_argument("endpoint", metavar="ENDPOINT", nargs="?", default=None,
                   help="the PUB endpoint, e.g. tcp://HOST:5557 (data-parallel rank r publishes "
                   "on port + r); or a fleet with --endpoint / --fleet")
    p.add_argument("--endpoint", dest="fleet_endpoints", action="append", default=None,
                   metavar="NAME=ENDPOINT[,REPLAY][,METRICS]",
                   help="one instance of a fleet, named; repeatable (each its own subscriber "
                   "and health)")
    p.add_argument("--fleet", metavar="FILE", default=None,
                   help="a fleet file: one instance per line, `name endpoint [replay] "
                   "[metrics]` ('-' for none; '#' comments)")
    p.add_argument("--replay", metavar="ENDPOINT", default=None,
                   help="the replay endpoint, e.g. tcp://HOST:5558: history on attach and "
                   "missed batches on every sequence gap")
    p.add_argument("--topic", default="", help="the server's topic (default: all)")
    p.add_argument("--dp-ranks", type=positive_int, default=1, metavar="N",
                   help="data-parallel ranks: rank r publishes (and replays) on port + r "
                   "(default 1)")
    p.add_argument("--hash-check", choices=("sha256", "sha256_cbor"), default=None,
                   metavar="ALGO", help="recompute block hashes from the published token ids "
                   "with the server's --prefix-caching-hash-algo (sha256 or sha256_cbor) and "
                   "flag the blocks that differ")
    p.add_argument("--hash-seed", default=None, metavar="SEED",
                   help="with --hash-check: the server's PYTHONHASHSEED (default: vLLM's fixed "
                   "seed, vllm-none-hash, as vLLM >= 0.29 uses; older servers draw a random one)")
    p.add_argument("--vllm-version", default=None, metavar="X.Y[.Z]",
                   help="with --hash-check: the server's vLLM version, for its rule of extra "
                   "keys (tagged when hashed since 0.31, published since 0.17) and NONE_HASH "
                   "seed (default: the form is detected from the stream)")
    p.add_argument("--lora-path", action="append", default=None, metavar="NAME=PATH",
                   help="with --hash-check: the path the server loaded LoRA adapter NAME from "
                   "(vLLM >= 0.31 hashes it, its events carry only the name); repeatable")
    p.add_argument("--metrics", metavar="URL", default=None,
                   help="the server's Prometheus endpoint, e.g. http://HOST:8000/metrics: "
                   "prefix-cache queries/hits, KV usage, preemptions, TTFT and ITL, scraped "
                   "every second beside the events")
    p.add_argument("--record", metavar="FILE", default=None,
                   help="record the attached session to a .kvscope file (replays like any "
                   "other: kvscope replay FILE)")
    p.add_argument("--overwrite", action="store_true", help="with --record: replace FILE")
    p.add_argument("--slots", type=positive_int, default=None, metavar="N",
                   help="hash slots shown and recorded: one per resident block hash (physical "
                   "block ids are not published; default 4096)")
    p.add_argument("--headless", action="store_true",
                   help="no window: listen for --duration seconds, print summary and health")
    p.add_argument("--duration", type=_seconds, default=10.0, metavar="S",
                   help="with --headless: seconds to listen (default 10)")
    p.set_defaults(func=cmd_attach)


def cmd_attach(args: argparse.Namespace) -> int:
    instances, problem = fleet_of(args)
    if problem is None and instances is None:
        problem = check_addresses(args.endpoint, args.replay, args.metrics)
    if problem is None:
        from kvscope.sessions.kv_events.parity import HashParity, HashSettings, lora_paths

        seed = {} if args.hash_seed is None else {"seed": args.hash_seed}
        try:  # bad values are refused headless or not, before anything listens
            settings = HashSettings(args.hash_check or "sha256", vllm_version=args.vllm_version,
                                    lora_paths=lora_paths(args.lora_path), **seed)
        except ValueError as e:
            problem = str(e)
    if problem:
        print(f"kvscope: error: {problem}", file=sys.stderr)
        return 2
    if instances is not None:
        from kvscope.app.cli.attach_fleet import attach_fleet

        parities = [HashParity(settings) for _ in instances] if args.hash_check else None
        return attach_fleet(args, instances, parities)
    if not args.headless:
        from kvscope.app.window.gui import run_gui  # Qt is imported only here

        return run_gui(attach=dict(endpoint=args.endpoint, replay=args.replay, topic=args.topic,
                                   metrics=args.metrics, record=args.record,
                                   slots=args.slots, dp_ranks=args.dp_ranks))
    from kvscope.sessions.kv_events.metrics import MetricsError
    from kvscope.sessions.kv_events.session import AttachSession
    from kvscope.sessions.kv_events.slots import DEFAULT_SLOTS

    if args.record:  # refused in one line, nothing created (CliError: exit 2)
        from pathlib import Path

        from kvscope.app.cli.common import check_record_path

        check_record_path(Path(args.record), args.overwrite)
    parity = HashParity(settings) if args.hash_check else None
    try:
        session = AttachSession(args.endpoint, args.replay, args.topic, args.metrics,
                                args.record, args.dp_ranks, args.slots or DEFAULT_SLOTS, parity,
                                overwrite=args.overwrite, silent_s=float("inf"))
    except (ValueError, MetricsError) as e:
        print(f"kvscope: error: {e}", file=sys.stderr)
        return 2
    print(f"kvscope attach: {args.endpoint}" + (f", replay {args.replay}" if args.replay else "")
          + (f", {args.dp_ranks} data-parallel ranks" if args.dp_ranks > 1 else "")
          + (f", metrics {args.metrics}" if args.metrics else "")
          + (f", recording {args.record}" if args.record else "")
          + f", listening {args.duration:g} s", flush=True)
    listen_headless(session, args.duration)
    mirror = session.mirror
    usable = bool(mirror.health.first_seq)
    if not usable:
        print(f"kvscope: no KV events from {args.endpoint} in {args.duration:g} s "
              f"({sum(a.num_messages for a in session.attachments)} messages, "
              f"{mirror.health.bad_messages} not KV events): is the server publishing "
              "(--kv-events-config with \"publisher\": \"zmq\"), and are the address and topic "
              "right?", file=sys.stderr)
    print(session.summary())
    return 0 if usable else 2


def fleet_of(args: argparse.Namespace) -> tuple[list | None, str | None]:
    """(the fleet's instances, None) with --endpoint or --fleet; (None, None) for one endpoint;
    (None, why) when the arguments cannot be used."""
    if not (args.fleet_endpoints or args.fleet):
        return None, None if args.endpoint else "give an ENDPOINT, --endpoint NAME=ENDPOINT " \
            "(repeatable) or --fleet FILE"
    if args.endpoint or args.replay or args.metrics or args.dp_ranks > 1:
        return None, "a fleet (--endpoint, --fleet) names each instance's replay and metrics " \
            "itself: no ENDPOINT, --replay, --metrics or --dp-ranks beside it"
    from kvscope.sessions.kv_events.fleet import check_fleet, parse_endpoint_option, read_fleet

    try:
        instances = [parse_endpoint_option(e) for e in args.fleet_endpoints or ()]
        if args.fleet:
            instances += read_fleet(args.fleet)
        check_fleet(instances)
    except ValueError as e:
        return None, str(e)
    return instances, None


def check_addresses(endpoint: str, replay: str | None, metrics: str | None) -> str | None:
    """Why these addresses cannot be used (None: they can), without connecting anywhere."""
    for name, value in (("endpoint", endpoint), ("replay endpoint", replay)):
        if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
            return f"{name} {value!r} is not a ZMQ address (tcp://HOST:PORT, ipc://PATH)"
    if metrics is not None and not metrics.startswith(("http://", "https://")):
        return f"metrics URL {metrics!r} is not http(s)://HOST:PORT/metrics"
    return None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= 7 * 24 * 3600:
        raise argparse.ArgumentTypeError(f"must be more than 0 s and at most a week, got {text}")
    return value
