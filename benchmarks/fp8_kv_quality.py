#!/usr/bin/env python
"""How much does an fp8 KV cache cost in quality, and what does it save in memory?

For a tiny random Llama (built here, seeded) and the demo model (if built), runs 64 greedy
decode steps with the unquantised cache ("auto": the model dtype, float32 on CPU), 16-bit
caches (float16, bfloat16), and fp8 (e4m3) with unit scales and with calibrated per-layer scales.

Printed per cache:
- KV bytes per token, from the real cache tensor (asserted: fp8 is exactly half of 16-bit);
- logit deviation from the unquantised run, teacher-forced on the unquantised greedy tokens
  (so every step sees the same context): per step the max and mean |delta logit|, summarised
  as median and max over the steps;
- greedy-token agreement: teacher-forced argmax agreement (x/64), and free-running greedy
  agreement with the step of first divergence.

Usage: .venv/bin/python benchmarks/fp8_kv_quality.py [--steps 64] [--no-demo]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from kvscope.engine.model_runner import ModelRunner, SeqChunk  # noqa: E402
from kvscope.engine.models.load import LoadedModel, ModelLoadError, load_model  # noqa: E402

BLOCK_SIZE = 16
CACHES = [("auto", "unit"), ("float16", "unit"), ("bfloat16", "unit"), ("fp8", "unit"),
          ("fp8", "calibrated")]


def build_random_llama(folder: Path) -> None:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, initializer_range=0.1,
        max_position_embeddings=1024, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)


class Sequence:
    """One sequence on its own runner, blocks taken in order."""

    def __init__(self, runner: ModelRunner, prompt: list[int]):
        self.runner, self.tokens, self.table, self.done = runner, list(prompt), [], 0

    def step(self, new_tokens: list[int]) -> torch.Tensor:
        self.tokens += new_tokens
        end = len(self.tokens)
        while len(self.table) * BLOCK_SIZE < end:
            self.table.append(len(self.table))
        chunk = SeqChunk(self.tokens[self.done:end], self.done, list(self.table))
        self.done = end
        return self.runner.run([chunk])[0]


def make_runner(loaded: LoadedModel, cache: str, scales: str, prompt, steps) -> ModelRunner:
    blocks = (len(prompt) + steps) // BLOCK_SIZE + 2
    runner = ModelRunner(loaded, num_blocks=blocks, block_size=BLOCK_SIZE, kv_cache_dtype=cache)
    if scales == "calibrated":
        runner.calibrate_kv_scales([prompt])  # calibrated on the prompt itself
    return runner


def greedy(runner: ModelRunner, prompt: list[int], steps: int, forced: list[int] | None = None):
    """Logits of each step and the argmax tokens; with ``forced``, feed those tokens instead."""
    seq = Sequence(runner, prompt)
    logits = [seq.step([])]
    tokens = [int(logits[0].argmax())]
    for i in range(1, steps):
        logits.append(seq.step([forced[i - 1] if forced else tokens[-1]]))
        tokens.append(int(logits[-1].argmax()))
    return logits, tokens


def first_divergence(a: list[int], b: list[int]) -> str:
    return next((str(i) for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), "none")


def evaluate(name: str, loaded: LoadedModel, prompt: list[int], steps: int) -> None:
    cfg = loaded.config
    print(f"\n== {name}: {cfg.architecture}, {cfg.num_layers} layers, {cfg.num_kv_heads} kv heads"
          f" x head_dim {cfg.head_dim}, model dtype {loaded.dtype}, prompt {len(prompt)} tokens,"
          f" {steps} greedy steps")
    ref_runner = make_runner(loaded, "auto", "unit", prompt, steps)
    ref_logits, ref_tokens = greedy(ref_runner, prompt, steps)

    stacked = torch.stack(ref_logits)
    top2 = stacked.topk(2, dim=-1).values
    print(f"unquantised logits: std {stacked.std().item():.3f}, median top-1 margin "
          f"{(top2[:, 0] - top2[:, 1]).median().item():.3f}")
    print(f"{'kv cache':<22}{'bytes/token':>12}{'max|dl| med':>13}{'max|dl| max':>13}"
          f"{'mean|dl| med':>14}{'forced agree':>14}{'free agree':>12}{'1st diverge':>13}")
    nbytes = {}
    for cache, scales in CACHES:
        runner = ref_runner if cache == "auto" else make_runner(loaded, cache, scales, prompt,
                                                                 steps)
        nbytes[cache] = (runner.kv_bytes_per_token, runner.kv_cache.nbytes / runner.num_blocks)
        forced_logits, forced_tokens = (
            (ref_logits, ref_tokens) if cache == "auto"
            else greedy(make_runner(loaded, cache, scales, prompt, steps), prompt, steps,
                        forced=ref_tokens))
        _, free_tokens = (ref_logits, ref_tokens) if cache == "auto" else greedy(
            runner, prompt, steps)
        dev = [(a - b).abs() for a, b in zip(forced_logits, ref_logits, strict=True)]
        max_dev = [d.max().item() for d in dev]
        mean_dev = [d.mean().item() for d in dev]
        forced_agree = sum(a == b for a, b in zip(forced_tokens, ref_tokens, strict=True))
        free_agree = sum(a == b for a, b in zip(free_tokens, ref_tokens, strict=True))
        label = (f"fp8 e4m3, {scales}" if cache == "fp8"
                 else str(runner.cache_dtype).replace("torch.", ""))
        print(f"{label:<22}{runner.kv_bytes_per_token:>12}{statistics.median(max_dev):>13.2e}"
              f"{max(max_dev):>13.2e}{statistics.median(mean_dev):>14.2e}"
              f"{forced_agree:>9}/{steps:<4}{free_agree:>7}/{steps:<4}"
              f"{first_divergence(free_tokens, ref_tokens):>13}")

    # fp8 halves the 16-bit cache: checked on the real tensors, not on a formula.
    for half in ("float16", "bfloat16"):
        assert nbytes["fp8"][0] * 2 == nbytes[half][0], nbytes
        assert nbytes["fp8"][1] * 2 == nbytes[half][1], nbytes
    print(f"fp8 KV bytes/token {nbytes['fp8'][0]} = 1/2 of float16/bfloat16 "
          f"{nbytes['bfloat16'][0]}"
          f" = 1/4 of {loaded.dtype} {nbytes['auto'][0]} (from the cache tensors)")
    text_of = getattr(loaded.tokenizer, "decode", None)
    if text_of:
        print("unquantised greedy text:", repr(text_of(ref_tokens, skip_special_tokens=True)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--no-demo", action="store_true", help="skip the demo model")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        build_random_llama(Path(tmp))
        gen = torch.Generator().manual_seed(1)
        prompt = torch.randint(3, 1024, (40,), generator=gen).tolist()
        evaluate("tiny random Llama", load_model(tmp), prompt, args.steps)

    if not args.no_demo:
        try:
            demo = load_model("demo")
        except ModelLoadError as e:
            print(f"\n== demo model skipped: {e}")
            return 0
        prompt = demo.tokenizer.encode(
            "The with statement is used to wrap the execution of a block with methods")
        evaluate("demo model", demo, prompt, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
