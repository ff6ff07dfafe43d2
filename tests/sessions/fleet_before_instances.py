"""Made tests/data/fleet_before_instances.kvscope with kvscope as of commit 7118bf2 (before a
fleet's block events named their instance): three fake publishers attached as one fleet and
recorded to one session (64 hash slots); beta drops a block, gamma's publisher restarts.

    python tests/sessions/fleet_before_instances.py OUT.kvscope   (with kvscope at 7118bf2)
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_fake_publisher import FakePublisher, batch, removed, stored  # noqa: E402

from kvscope.sessions.kv_events.fleet import Instance  # noqa: E402
from kvscope.sessions.kv_events.fleet_session import FleetSession  # noqa: E402


def main(out: str) -> None:
    fakes = [FakePublisher() for _ in range(3)]
    names = ["alpha", "beta", "gamma"]
    s = FleetSession([Instance(n, f.endpoint, f.replay_endpoint)
                      for n, f in zip(names, fakes, strict=True)],
                     record=out, num_slots=64, tick_s=0.05, overwrite=True).start()
    for f in fakes:
        f.wait_subscribed(timeout_s=10)
    a, b, c = fakes
    a.send(0, batch([stored([1, 2, 3], None), stored([4], 3)]))
    b.send(0, batch([stored([1, 2], None), stored([8], None, medium="CPU")]))
    c.send(0, batch([stored([9], None)]))
    time.sleep(0.5)
    b.send(1, batch([removed([2]), stored([5], 1)]))
    with c._lock:
        c.buffer.clear()
    c.send(0, batch([stored([10, 11], None)]))
    time.sleep(0.5)
    s.stop()
    print([(r.name, r.resident, r.restarts) for r in s.rows])
    for f in fakes:
        f.close()


if __name__ == "__main__":
    main(sys.argv[1])
