"""`kvscope serve --kv-events` in a child process, as a real publisher for attach tests."""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager


class Served:
    endpoint: str
    replay: str
    batches: int = 0  # what it says it published, once it exited
    events: int = 0
    cache: str = ""  # its engine's cache at the end (kv_events.fleet.snapshot_digest)


@contextmanager
def serve_kv_events(wait_s: int = 1, *extra: str, endpoint: str = "tcp://127.0.0.1:*",
                    replay: str = "tcp://127.0.0.1:*"):
    """Runs the eviction-pressure workload on a 48-block pool, publishing on loopback (or the
    endpoints given: ipc ones, to restart it on the same); yields a Served (endpoints now;
    counts after `finish`)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvscope.app", "serve", "--kv-events", endpoint,
         "--kv-events-replay", replay, "--workload", "eviction_pressure",
         "--num-blocks", "48", "--block-size", "4", "--wait", str(wait_s), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    served = Served()
    served.proc = proc
    try:
        lines = [proc.stdout.readline() for _ in range(2)]
        assert lines[1].startswith("publishing KV events on "), lines
        served.endpoint, served.replay = (w.rstrip(",") for w in lines[1].split()[4::3])
        yield served
    finally:
        proc.kill()
        proc.wait()


def finish(served: Served) -> None:
    """After the process exited: read what it says it published."""
    out = served.proc.stdout.read()
    published = next(ln for ln in out.splitlines() if ln.startswith("published"))
    served.batches, served.events = int(published.split()[1]), int(published.split()[3])
    served.cache = next(ln for ln in out.splitlines()
                        if ln.startswith("cache at the end: ")).split(": ", 1)[1]
