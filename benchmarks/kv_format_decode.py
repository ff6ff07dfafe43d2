"""Decode time per KV format, the C decode attention against the torch reference (a script, not
a test).

For each model (the demo model, SmolLM2-135M), each KV format and each kernel path ("cpu": the
C decode attention reading the format packed in place, kernels/cpu_formats.py; "torch": the
reference, which dequantizes the gathered blocks and attends), the same prompts (``--batch``
sequences of ``--context`` tokens, seeded random ids) are prefilled once, then ``--steps``
decode steps are timed on the same forced tokens. Printed per row: the median step time, the
median time of the decode attention calls within a step (the layers' sum), and the step's
ratio to float32 and to bfloat16 on the same path. Every step here runs the per-op layer path
(the one-call float32 C step, ``DecoderWeights``, only takes float32 caches; its time is
printed on its own line for reference). The store stays the torch reference's for packed
formats on both paths. One untimed warm-up step first; float32 weights, ``--threads`` (1).

    .venv/bin/python benchmarks/kv_format_decode.py [--context 1024] [--batch 4] [--steps 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from kvscope.engine.model_runner import ModelRunner, SeqChunk  # noqa: E402
from kvscope.engine.models.load import ModelLoadError, load_model  # noqa: E402
from kvscope.kernels import cpu  # noqa: E402

FORMATS = ["float32", "bfloat16", "fp8", "fp8_per_head", "int8_per_token_head",
           "int4_per_token_head", "kivi4", "kivi2"]
BLOCK_SIZE = 16


class Timed:
    """Wraps the runner's decode attention, summing its time per step."""

    def __init__(self, fn):
        self.fn, self.total = fn, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self.total += time.perf_counter() - start
        return out


def measure(loaded, fmt: str, impl: str, prompts: list[list[int]], forced: list[int],
            whole_step: bool = False) -> tuple[float, float]:
    """(median step seconds, median decode attention seconds per step)."""
    steps = len(forced)
    blocks_per_seq = -(-(max(map(len, prompts)) + steps + 1) // BLOCK_SIZE)
    runner = ModelRunner(loaded, blocks_per_seq * len(prompts), BLOCK_SIZE, fmt, kernel_impl=impl,
                         max_num_seqs=len(prompts))
    timed = Timed(runner.kernels.paged_decode_attention)
    runner.kernels = dataclasses.replace(runner.kernels, paged_decode_attention=timed)
    tables = [list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq))
              for b in range(len(prompts))]
    tokens = [list(p) for p in prompts]
    runner.run([SeqChunk(t, 0, table) for t, table in zip(tokens, tables, strict=True)])
    original = cpu.DecoderWeights.run
    if not whole_step:
        cpu.DecoderWeights.run = lambda *args, **kwargs: False
    try:
        step_times, attn_times = [], []
        for i, tok in enumerate([forced[0], *forced]):  # the first step is a warm-up
            chunks = []
            for t, table in zip(tokens, tables, strict=True):
                t.append(tok)
                chunks.append(SeqChunk([tok], len(t) - 1, table))
            timed.total = 0.0
            start = time.perf_counter()
            runner.run(chunks)
            if i:
                step_times.append(time.perf_counter() - start)
                attn_times.append(timed.total)
    finally:
        cpu.DecoderWeights.run = original
    return statistics.median(step_times), statistics.median(attn_times)


def bench(name: str, loaded, args) -> None:
    cfg = loaded.config
    rng = random.Random(0)
    prompts = [[rng.randrange(3, cfg.vocab_size) for _ in range(args.context)]
               for _ in range(args.batch)]
    forced = [rng.randrange(3, cfg.vocab_size) for _ in range(args.steps)]
    print(f"\n== {name}: {cfg.num_layers} layers, {cfg.num_heads} heads, {cfg.num_kv_heads} KV "
          f"heads, head_dim {cfg.head_dim}; batch {args.batch} x {args.context} tokens of "
          f"context, {args.steps} steps")
    whole, _ = measure(loaded, "float32", "cpu", prompts, forced, whole_step=True)
    print(f"float32, one-call C step (DecoderWeights): {whole * 1e3:.2f} ms/step")
    print(f"{'format':<22}{'path':<7}{'step ms':>9}{'attn ms':>9}{'vs f32':>8}{'vs bf16':>9}"
          f"{'attn C/torch':>14}")
    results = {(fmt, impl): measure(loaded, fmt, impl, prompts, forced)
               for fmt in FORMATS for impl in ("cpu", "torch")}
    for fmt in FORMATS:
        for impl in ("cpu", "torch"):
            step, attn = results[fmt, impl]
            ratio = (f"{results[fmt, 'cpu'][1] / results[fmt, 'torch'][1]:>14.2f}"
                     if impl == "cpu" else "")
            print(f"{fmt:<22}{impl:<7}{step * 1e3:>9.2f}{attn * 1e3:>9.2f}"
                  f"{step / results['float32', impl][0]:>8.2f}"
                  f"{step / results['bfloat16', impl][0]:>9.2f}{ratio}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default="demo,smollm2")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{args.threads} thread(s); medians over {args.steps} steps")
    with torch.inference_mode():
        for name in args.models.split(","):
            try:
                loaded = load_model(name, dtype=torch.float32)
            except ModelLoadError as e:
                print(f"\n== {name} skipped: {e}")
                continue
            bench(name, loaded, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
