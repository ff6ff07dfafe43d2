"""`kvscope attach`: mirror a vLLM or SGLang server's prefix cache from its KV events.

    kvscope attach tcp://HOST:5557 [--replay tcp://HOST:5558] [--topic T] [--dp-ranks N]
                   --headless --duration S
                   [--hash-check sha256 [--hash-seed SEED]]

Headless: listen for S seconds, then print the mirror's summary and health. A bad address is
an error (exit 2); an endpoint that sends nothing, or sends something that is not KV events, is
reported at the end (exit 2 when nothing usable arrived) and never stops the listening early.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    from kvscope.app.cli import _positive_int

    p = sub.add_parser("attach", help="mirror a vLLM/SGLang server's KV cache from its events",
                       description="Subscribe to a vLLM or SGLang server's KV-cache events "
                       "(--kv-events-config with publisher zmq) and rebuild its prefix cache.")
    p.add_argument("endpoint", metavar="ENDPOINT", help="the PUB endpoint, e.g. "
                   "tcp://HOST:5557 (data-parallel rank r publishes on port + r)")
    p.add_argument("--replay", metavar="ENDPOINT", default=None,
                   help="the replay endpoint, e.g. tcp://HOST:5558: history on attach and "
                   "missed batches on every sequence gap")
    p.add_argument("--topic", default="", help="the server's topic (default: all)")
    p.add_argument("--dp-ranks", type=_positive_int, default=1, metavar="N",
                   help="data-parallel ranks: rank r publishes (and replays) on port + r "
                   "(default 1)")
    p.add_argument("--hash-check", choices=("sha256", "sha256_cbor"), default=None,
                   metavar="ALGO", help="recompute block hashes from the published token ids "
                   "with the server's --prefix-caching-hash-algo (sha256 or sha256_cbor) and "
                   "flag the blocks that differ")
    p.add_argument("--hash-seed", default="vllm-none-hash", metavar="SEED",
                   help="with --hash-check: the server's PYTHONHASHSEED (default: vLLM's fixed "
                   "seed, vllm-none-hash)")
    p.add_argument("--headless", action="store_true",
                   help="no window: listen for --duration seconds, print summary and health")
    p.add_argument("--duration", type=_seconds, default=10.0, metavar="S",
                   help="with --headless: seconds to listen (default 10)")
    p.set_defaults(func=cmd_attach)


def cmd_attach(args: argparse.Namespace) -> int:
    if not args.headless:
        print("kvscope: error: attaching in the window is not available yet; use --headless "
              "[--duration S]", file=sys.stderr)
        return 2
    from kvscope.sessions.kv_events import Attachment, Mirror
    from kvscope.sessions.kv_events.parity import HashParity, HashSettings
    from kvscope.sessions.kv_events.subscriber import listen, rank_endpoint

    mirror = Mirror(HashParity(HashSettings(args.hash_check, args.hash_seed))
                    if args.hash_check else None)
    attachments = []
    try:
        for r in range(args.dp_ranks):
            replay = rank_endpoint(args.replay, r) if args.replay else None
            attachments.append(Attachment(rank_endpoint(args.endpoint, r), replay, args.topic,
                                          mirror))
    except ValueError as e:
        for a in attachments:
            a.close()
        print(f"kvscope: error: {e}", file=sys.stderr)
        return 2
    print(f"kvscope attach: {args.endpoint}" + (f", replay {args.replay}" if args.replay else "")
          + (f", {args.dp_ranks} data-parallel ranks" if args.dp_ranks > 1 else "")
          + f", listening {args.duration:g} s", flush=True)
    try:
        for a in attachments:
            a.start()
        listen(attachments, args.duration)
    except KeyboardInterrupt:
        print("interrupted")
    finally:
        for a in attachments:
            a.close()
    usable = bool(mirror.health.first_seq)
    if not usable:
        print(f"kvscope: no KV events from {args.endpoint} in {args.duration:g} s "
              f"({sum(a.num_messages for a in attachments)} messages, "
              f"{mirror.health.bad_messages} not KV events): is the server publishing "
              "(--kv-events-config with \"publisher\": \"zmq\"), and are the address and topic "
              "right?", file=sys.stderr)
    print(mirror.summary())
    return 0 if usable else 2


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= 7 * 24 * 3600:
        raise argparse.ArgumentTypeError(f"must be more than 0 s and at most a week, got {text}")
    return value
