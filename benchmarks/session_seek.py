"""Session recording and replay: seek latency, recording throughput, engine overhead.

1. Records a session of at least --events engine events (a tiny random Llama on a 16,384-block
   pool, 64 sequences per step, block size 4, shared prefixes, so allocations, cache hits,
   evictions and preemptions all happen) and reports the recording rate in events/s, the writer
   thread's CPU per event (its capacity), the file size and how far behind the writer ever was.
2. Opens it with SessionReader and times `snapshot_at` for random steps (a fresh reader; random
   order, so nearly every call decodes a keyframe and replays up to a keyframe interval of
   events): median / p95 / max. Also the rate of sequential playback.
3. Runs the same fixed workload with recording off and on, --runs rounds, and prints the
   engine's throughput with recording on as a ratio of off (time of the stepping loop; starting
   and closing the recorder are one-off costs of a few ms, outside the loop). Two baselines:
   "off" is the engine with no observer, "drained" has one subscriber (a StepQueue drained each
   step), the fairer one: it pays for building each step's StepUpdate as the recorder does. Each
   round runs the three back to back in a shuffled order; the ratios are the
   median over rounds and best-of-N (the minimum time of each: other processes only ever add
   time). Configurations: the tiny model (its steps are the cheapest, so the recorder's share is
   the largest: the worst case) on a 4,096- and a 16,384-block pool, and the demo model (a real
   tokenizer; output text is decoded every token). On a shared machine these wall-clock ratios
   swing by +-20% from round to round, so each configuration also prints the recorder's own CPU
   time per step (capture on the engine thread + the writer thread), measured with
   time.thread_time, which other processes do not disturb: the ratio if all of it ran in series
   with the engine is a noise-free estimate of the overhead.
4. Between 2 and 3: what keying the block hashes per file (the default, Recorder.stored_hash)
   costs against raw hashes: the writer's CPU per event and the capture's per step.

Run: .venv/bin/python benchmarks/session_seek.py [--events 100000] [--runs 9] [--seeks 200]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from kvscope.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from kvscope.engine.models.load import load_model  # noqa: E402
from kvscope.engine.stream import StepQueue
from kvscope.sessions import Recorder, SessionReader  # noqa: E402
from kvscope.sessions import recorder as recorder_module  # noqa: E402


def tiny_model(folder: Path) -> Path:
    """A 2-layer random Llama (hidden 64, vocab 320), built locally and saved."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def add_workload(engine: Engine, num_requests: int, seed: int = 0, vocab: int = 320) -> None:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(96)]
    for _ in range(num_requests):
        prefix = shared[: rng.randrange(0, 96)] if rng.random() < 0.6 else []
        prompt = prefix + [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 120))]
        engine.add_request(prompt, SamplingParams(max_tokens=rng.randrange(8, 64),
                                                  ignore_eos=True))


def make_engine(loaded_path, num_blocks: int) -> Engine:
    return Engine(load_model(loaded_path), EngineConfig(
        block_size=4, num_blocks=num_blocks, max_num_seqs=64, max_num_batched_tokens=512))


class RecorderClock:
    """Sums the CPU time the recorder spends: capturing on the engine thread after each step,
    and in the writer thread's batches."""

    def __init__(self):
        self.capture_s = self.writer_s = 0.0
        self.steps = 0
        cls = recorder_module.Recorder
        self._orig = (cls._write, cls._on_update)
        write, after = self._orig
        clock = self

        def timed_write(rec, batch):
            t = time.thread_time()
            try:
                write(rec, batch)
            finally:
                clock.writer_s += time.thread_time() - t

        def timed_after(rec, update):
            t = time.thread_time()
            after(rec, update)
            clock.capture_s += time.thread_time() - t
            clock.steps += 1

        cls._write, cls._on_update = timed_write, timed_after

    def restore(self) -> None:
        recorder_module.Recorder._write, recorder_module.Recorder._on_update = self._orig


def record_big(model: Path, path: Path, min_events: int, quiet: bool = False,
               **rec_kw) -> tuple[float, float]:
    """Record; print what it cost unless quiet. Returns the writer's CPU per event and the
    capture's CPU per step on the engine thread (seconds)."""
    engine = make_engine(model, 16_384)
    clock = RecorderClock()
    rec = Recorder(path, engine, **rec_kw)
    rec.start()
    seed = 0
    t0 = time.perf_counter()
    while rec.status().events_captured < min_events or engine.has_unfinished():
        if not engine.has_unfinished():
            add_workload(engine, 200, seed=seed)
            seed += 1
        engine.step()
    wall = time.perf_counter() - t0
    status = rec.close()
    clock.restore()
    per_event, per_step = clock.writer_s / status.events_written, clock.capture_s / clock.steps
    if quiet:
        return per_event, per_step
    print(f"recorded {status.events_written:,} events over {status.steps_written:,} steps in "
          f"{wall:.1f} s: {status.events_written / wall:,.0f} events/s "
          f"(bounded by the engine; {engine.num_steps / wall:.0f} steps/s)")
    print(f"  writer thread CPU: {clock.writer_s * 1e6 / status.events_written:.2f} us per event "
          f"(capacity ~{status.events_written / clock.writer_s:,.0f} events/s); capture on the "
          f"engine thread {clock.capture_s * 1e6 / clock.steps:.0f} us per step; "
          f"{status.keyframes_written} keyframes, max backlog {status.max_backlog_steps} steps, "
          f"lagging episodes {status.lag_episodes}")
    print(f"  file: {path.stat().st_size / 1e6:.1f} MB "
          f"({path.stat().st_size / status.events_written:.0f} bytes per event, keyframes "
          "included)")
    return per_event, per_step


def hash_keying(model: Path, tmp: Path, events: int, runs: int) -> None:
    """What storing block hashes keyed per file (the default) costs against raw hashes: writer
    CPU per event and engine-thread capture per step, medians over rounds run alternately."""
    got = {True: [], False: []}
    for i in range(runs):
        for raw in (i % 2 == 0, i % 2 != 0):
            path = tmp / f"hashes-{i}-{raw}.kvscope"
            got[raw].append(record_big(model, path, events, quiet=True, raw_hashes=raw))
            os.remove(path)
    med = {raw: [statistics.median(x[j] for x in got[raw]) for j in (0, 1)] for raw in got}
    (kw, kc), (rw, rc) = med[False], med[True]
    print(f"keyed vs raw block hashes ({runs} rounds of {events:,} events, medians): writer "
          f"{kw * 1e6:.2f} vs {rw * 1e6:.2f} us per event (ratio {kw / rw:.2f}); capture on the "
          f"engine thread {kc * 1e6:.0f} vs {rc * 1e6:.0f} us per step (ratio {kc / rc:.2f})")


def seek(path: Path, n: int) -> None:
    with SessionReader(path) as s:
        steps = list(s.step_numbers)
        rng = random.Random(1)
        sample = [rng.choice(steps) for _ in range(n)]
        s.snapshot_at(sample[0])  # sqlite page cache warm-up, as after opening in the GUI
        times = []
        for step in sample:
            t = time.perf_counter()
            s.snapshot_at(step)
            times.append(time.perf_counter() - t)
        times.sort()
        p95 = times[int(0.95 * (len(times) - 1))]
        kf = s.keyframe_steps
        gaps = [b - a for a, b in zip(kf, kf[1:], strict=False)] or [0]
        print(f"snapshot_at, {n} random steps of {len(steps):,} ({s.meta.num_blocks:,} blocks, "
              f"keyframes every {statistics.median(gaps):.0f} steps (median)): median "
              f"{statistics.median(times) * 1e3:.1f} ms, p95 {p95 * 1e3:.1f} ms, "
              f"max {times[-1] * 1e3:.1f} ms (target < 50 ms)")
        first = steps[len(steps) // 2]
        last = min(steps[-1], first + 199)
        t = time.perf_counter()
        frames = sum(1 for _ in s.playback(first, last))
        dt = time.perf_counter() - t
        print(f"sequential playback: {frames / dt:,.0f} frames/s ({dt / frames * 1e3:.2f} ms "
              "per frame with its events and snapshot)")


def engine_run(model, num_blocks: int, num_requests: int, mode: str,
               demo: bool = False, tmp: Path | None = None) -> float:
    """Seconds the engine takes to step through a fixed workload. mode: "off" (no observer),
    "drained" (a subscriber that drops every update: the events are freed each step), "on"
    (recording). Starting and closing the recorder are outside the timed loop (see main)."""
    if demo:
        engine = Engine.from_pretrained("demo", EngineConfig(
            num_blocks=num_blocks, max_num_seqs=32, max_num_batched_tokens=512))
        add_workload(engine, num_requests, vocab=2000)
    else:
        engine = make_engine(model, num_blocks)
        add_workload(engine, num_requests)
    sub = StepQueue() if mode == "drained" else None
    if sub is not None:
        engine.subscribe(sub)
    rec = None
    if mode == "on":
        rec = Recorder(tempfile.mktemp(suffix=".kvscope", dir=tmp), engine).start()
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        if sub is not None:
            sub.drain()
    wall = time.perf_counter() - t
    if rec is not None:
        status = rec.close()
        assert status.error is None and status.steps_written == engine.num_steps, status
        os.remove(rec.path)
    return wall


def overhead(model: Path, tmp: Path, runs: int) -> None:
    print(f"engine throughput with recording on, as a ratio of off ({runs} rounds per "
          "configuration, each round runs off / drained / on back to back in a shuffled order)")
    configs = [("tiny model, 4,096 blocks", 4096, 200, False),
               ("tiny model, 16,384 blocks", 16384, 200, False),
               ("demo model, 2,048 blocks", 2048, 40, True)]
    for name, blocks, reqs, demo in configs:
        engine_run(model, blocks, 20, "off", demo)  # warm-up (allocator, caches)
        times = {"off": [], "drained": [], "on": []}
        clock = RecorderClock()
        for i in range(runs):
            order = list(times)
            random.Random(i).shuffle(order)
            for mode in order:
                times[mode].append(engine_run(model, blocks, reqs, mode, demo, tmp))
        clock.restore()
        vs_off = [a / b for a, b in zip(times["off"], times["on"], strict=True)]
        vs_drained = [a / b for a, b in zip(times["drained"], times["on"], strict=True)]
        step_s = statistics.median(times["drained"]) * runs / clock.steps
        capture, writer = clock.capture_s / clock.steps, clock.writer_s / clock.steps
        print(f"  {name}: off {statistics.median(times['off']):.2f} s, drained "
              f"{statistics.median(times['drained']):.2f} s, on "
              f"{statistics.median(times['on']):.2f} s (medians)")
        print(f"    on/off      median of rounds {statistics.median(vs_off):.3f}, "
              f"best-of-{runs} {min(times['off']) / min(times['on']):.3f}  "
              f"[{' '.join(f'{r:.2f}' for r in vs_off)}]")
        print(f"    on/drained  median of rounds {statistics.median(vs_drained):.3f}, "
              f"best-of-{runs} {min(times['drained']) / min(times['on']):.3f}  "
              f"[{' '.join(f'{r:.2f}' for r in vs_drained)}]")
        share = (capture + writer) / step_s
        print(f"    recorder CPU per {step_s * 1e3:.1f} ms step: capture {capture * 1e6:.0f} us "
              f"(engine thread) + writer {writer * 1e6:.0f} us (its own thread, partly outside "
              f"the GIL) = {share:.1%}; if all of it ran in series with the engine: ratio "
              f"{1 / (1 + share):.3f} (a CPU-time estimate that other processes do not disturb)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only-hashes", action="store_true", help="run part 4 only")
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--seeks", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, torch threads {args.threads}")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = tiny_model(tmp / "tiny")
        if args.only_hashes:
            hash_keying(model, tmp, min(args.events, 30_000), args.runs)
            return
        session = tmp / "big.kvscope"
        record_big(model, session, args.events)
        seek(session, args.seeks)
        hash_keying(model, tmp, min(args.events, 30_000), args.runs)
        overhead(model, tmp, args.runs)


if __name__ == "__main__":
    main()
