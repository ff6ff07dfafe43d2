"""What the live history costs: the engine process always records its session (no text) to a
temporary file so that the window can show any past step. This runs the real engine host (in a
thread, with a window stand-in that takes every frame at once, which is the most frames the
host ever builds) through a fixed workload on the demo model, with the history on and off,
interleaved in a shuffled order each round, and prints the engine's throughput with the history
as a ratio of without: the median over rounds, and best-of-N (other processes only add time).
On a shared machine those wall-clock ratios swing widely, so it also prints the recorder's own
CPU time (capture on the engine thread + its writer thread, time.thread_time, which other
processes do not disturb) as a share of the engine thread's CPU time without the history: a
noise-free estimate of the cost if all of it ran in series with the engine.

Run: .venv/bin/python benchmarks/live_history.py [--runs 9] [--requests 128]
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from kvscope.app.host import protocol  # noqa: E402
from kvscope.app.host.server import EngineHost  # noqa: E402
from kvscope.engine.config import EngineConfig, SamplingParams  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from session_seek import RecorderClock  # noqa: E402

PREFIXES = ["You are a careful assistant for people who learn Python. " * 4,
            "Answer in one short paragraph, with an example. " * 4]
PARAMS = SamplingParams(max_tokens=32, ignore_eos=True)


def prompts(n: int) -> list[str]:
    return [PREFIXES[i % 2] + f"Question {i}: what does a list hold?" * (1 + i % 3)
            for i in range(n)]


def run(history: bool, n: int) -> tuple[float, int, float]:
    """Seconds from the first submit until the host is idle, the steps it ran, and the CPU
    seconds of the engine's thread after loading."""
    ours, theirs = socket.socketpair()
    host = EngineHost(Connection(theirs.detach()), keep_history=history)
    cpu = []
    load = host._load

    def timed_load(*args):  # the engine thread's CPU from when the model is loaded
        load(*args)
        cpu.append(time.thread_time())

    def serve():
        host.serve()
        cpu.append(time.thread_time() - cpu[0])

    host._load = timed_load

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    conn = Connection(ours.detach())
    conn.send(protocol.Load("demo", EngineConfig(num_blocks=512, block_size=16)))
    while not isinstance(conn.recv(), protocol.Loaded):
        pass
    t = time.perf_counter()
    for prompt in prompts(n):
        conn.send(protocol.Submit(prompt, PARAMS, None))
    conn.send(protocol.Resume())
    steps = 0
    while True:
        msg = conn.recv()
        if isinstance(msg, protocol.NewFrame):
            if msg.frame.records:
                steps = msg.frame.records[-1].step + 1
            conn.send(protocol.Ready())
        elif isinstance(msg, protocol.Idle):
            break
    wall = time.perf_counter() - t
    conn.send(protocol.Close())
    thread.join(30)
    return wall, steps, cpu[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--requests", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"torch threads 1, demo model, 512 blocks, {args.requests} requests x "
          f"{PARAMS.max_tokens} tokens")
    run(False, 4)  # warm-up
    times = {True: [], False: []}
    engine_cpu = {True: 0.0, False: 0.0}
    clock = RecorderClock()
    for i in range(args.runs):
        order = [True, False]
        random.Random(i).shuffle(order)
        for history in order:
            wall, steps, cpu = run(history, args.requests)
            times[history].append(wall)
            engine_cpu[history] += cpu
    clock.restore()
    ratios = [off / on for on, off in zip(times[True], times[False], strict=True)]
    print(f"without history {statistics.median(times[False]):.2f} s, with "
          f"{statistics.median(times[True]):.2f} s (medians of {args.runs}; {steps} steps)")
    print(f"throughput with history / without: median of rounds {statistics.median(ratios):.3f}, "
          f"best-of-{args.runs} {min(times[False]) / min(times[True]):.3f}  "
          f"[{' '.join(f'{r:.2f}' for r in ratios)}]")
    share = (clock.capture_s + clock.writer_s) / engine_cpu[False]
    print(f"recorder CPU: capture {clock.capture_s / clock.steps * 1e6:.0f} us + writer "
          f"{clock.writer_s / clock.steps * 1e6:.0f} us per step = {share:.1%} of the engine "
          f"thread's CPU without history; if all of it ran in series with the engine: ratio "
          f"{1 / (1 + share):.3f}")


if __name__ == "__main__":
    main()
