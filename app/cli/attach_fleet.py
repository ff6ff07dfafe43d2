"""`kvscope attach --endpoint NAME=URL ... | --fleet FILE`: a fleet, in the window or headless
(listen, then print each instance's mirror, health, parity and metrics, and the fleet's line)."""

from __future__ import annotations

import argparse
import sys

from kvscope.app.cli.common import listen_headless


def attach_fleet(args: argparse.Namespace, instances: list, parities: list | None) -> int:
    from kvscope.sessions.kv_events.slots import DEFAULT_SLOTS

    slots = args.slots or DEFAULT_SLOTS
    if not args.headless:
        from kvscope.app.window.gui import run_gui  # Qt is imported only here

        return run_gui(attach=dict(fleet=instances, topic=args.topic, record=args.record,
                                   slots=slots))
    from kvscope.sessions.kv_events.fleet_session import FleetSession
    from kvscope.sessions.kv_events.metrics import MetricsError

    if args.record:
        from pathlib import Path

        from kvscope.app.cli.common import check_record_path

        check_record_path(Path(args.record), args.overwrite)
    try:
        session = FleetSession(instances, args.topic, args.record, slots, parities,
                               overwrite=args.overwrite, silent_s=float("inf"))
    except (ValueError, MetricsError) as e:
        print(f"kvscope: error: {e}", file=sys.stderr)
        return 2
    print(f"kvscope attach: a fleet of {len(instances)} (" +
          ", ".join(f"{i.name} {i.endpoint}" for i in instances) + ")"
          + (f", recording {args.record}" if args.record else "")
          + f", listening {args.duration:g} s", flush=True)
    listen_headless(session, args.duration)
    silent = [i.name for r, i in enumerate(instances)
              if not session.mirror.health_of(r).first_seq]
    if silent:
        print(f"kvscope: no KV events from {', '.join(silent)} in {args.duration:g} s: are "
              "they publishing (--kv-events-config with \"publisher\": \"zmq\"), and are the "
              "addresses and topic right?", file=sys.stderr)
    print(session.summary())
    return 0 if len(silent) < len(instances) else 2
