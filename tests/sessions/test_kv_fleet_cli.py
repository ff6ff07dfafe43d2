"""`kvscope attach` with a fleet, headless: --endpoint (repeatable) and --fleet FILE; bad lines and
mixes are refused in one line."""

import subprocess
import sys

import pytest
from kv_fake_publisher import FakePublisher, batch, removed, stored


def attach(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "kvscope.app", "attach", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(("args", "why"), [
    (["--fleet", "{f}"], "line 2: endpoint 'nowhere' is not a ZMQ address"),
    (["--endpoint", "a=tcp://h:1", "--endpoint", "a=tcp://h:2"], "two instances have the name 'a'"),
    (["--endpoint", "tcp://h:1"], "expected NAME=ENDPOINT"),
    (["tcp://h:1", "--endpoint", "a=tcp://h:2"], "no ENDPOINT, --replay"),
    ([], "give an ENDPOINT"),
])
def test_bad_fleets_are_refused_in_one_line(tmp_path, args, why):
    f = tmp_path / "fleet.txt"
    f.write_text("a tcp://127.0.0.1:1\nb nowhere\n")
    r = attach(*[a.format(f=f) for a in args], "--headless", "--duration", "1")
    assert r.returncode == 2
    assert why in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_headless_fleet_prints_each_instance(tmp_path):
    fakes = [FakePublisher(), FakePublisher()]
    f = tmp_path / "fleet.txt"
    f.write_text(f"left {fakes[0].endpoint} {fakes[0].replay_endpoint}\n")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvscope.app", "attach", "--fleet", str(f), "--endpoint",
             f"right={fakes[1].endpoint}", "--headless", "--duration", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for fake in fakes:
            fake.wait_subscribed(timeout_s=15)
        fakes[0].send(0, batch([stored([1, 2, 3], None)]))
        fakes[1].send(0, batch([stored([1, 2], None)]))
        fakes[1].send(1, batch([removed([2])]))
        out, err = proc.communicate(timeout=30)
    finally:
        for fake in fakes:
            fake.close()
    assert proc.returncode == 0, err
    assert "a fleet of 2 (right tcp://" in out  # --endpoint first, then the file
    lines = out.splitlines()
    assert next(x for x in lines if x.startswith("instance left")).split(": resident ")[1] \
        .startswith("3 blocks")
    assert next(x for x in lines if x.startswith("instance right")).split(": resident ")[1] \
        .startswith("1 blocks")
    assert "fleet: 2 instances, 4 resident blocks, 1 block hashes held by more than one" in out
