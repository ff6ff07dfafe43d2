"""Can a fleet attach keep up with several busy vLLM servers at once? Block events per second, in
total, loopback.

Four publisher processes (the batches of attach_throughput.py: vLLM map encoding, uint64 hashes,
each batch storing a chain of 16 blocks and removing 16 older ones) each send as fast as they can
on a PUB socket of their own; one FleetSession (a subscriber thread per instance, one mirror, the
hash slots ticking beside) receives, decodes and applies them all. Reported, as the median over
repeats, in block events (one stored or removed hash) per second, all instances together, from
the first subscription to the last instance's last batch. Target: at least 50,000 in total.

Run: .venv/bin/python benchmarks/fleet_attach_throughput.py [--instances 4] [--batches 2000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from attach_throughput import CHAIN, TARGET, block_events, publish  # noqa: E402

from kvscope.sessions.kv_events.fleet import Instance  # noqa: E402
from kvscope.sessions.kv_events.fleet_session import FleetSession  # noqa: E402


def fleet_over_loopback(instances: int, n: int, port: int) -> float:
    endpoints = [f"tcp://127.0.0.1:{port + i}" for i in range(instances)]
    ready = [mp.Event() for _ in endpoints]
    procs = [mp.Process(target=publish, args=(e, n, r)) for e, r in zip(endpoints, ready,
                                                                         strict=True)]
    for p in procs:
        p.start()
    for r in ready:
        r.wait(30)
    session = FleetSession([Instance(f"i{i}", e) for i, e in enumerate(endpoints)],
                           silent_s=float("inf"))
    start = time.perf_counter()
    session.start()
    deadline = time.monotonic() + 300
    while any(a.last < n - 1 for a in session.attachments) and time.monotonic() < deadline:
        time.sleep(0.002)
    elapsed = time.perf_counter() - start
    session.stop()
    for p in procs:
        p.join(30)
    for rank, a in enumerate(session.attachments):
        h = session.mirror.health_of(rank)
        assert a.last == n - 1 and h.gaps == 0 and h.bad_messages == 0, (rank, h.lines())
    assert session.mirror.num_resident == instances * 4 * CHAIN, session.mirror.num_resident
    return instances * block_events(n) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--batches", type=int, default=2000, help="per instance")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    k, n = args.instances, args.batches
    rates = [fleet_over_loopback(k, n, 48_557 + 16 * r) for r in range(args.repeats)]
    med = statistics.median(rates)
    print(f"{k} instances x {n} batches ({k * block_events(n):,} block events), "
          f"{args.repeats} runs: " + ", ".join(f"{r:,.0f}" for r in rates) + " block events/s")
    print(f"fleet attach keeps up with {med:,.0f} block events/s in total: "
          f"{'meets' if med >= TARGET else 'BELOW'} the {TARGET:,} target ({med / TARGET:.1f} x)")


if __name__ == "__main__":
    main()
