"""Engine speed, measured side by side in one run (a script, not a test).

(a) Output-token throughput of our engine vs transformers on the same prompts and outputs:
    `model.generate()` (dynamic cache, one left-padded batch) and `model.generate_batch()`
    (transformers' continuous batching with a paged cache). 16 prompts of 64..154 tokens, 64
    greedy output tokens each (EOS ignored), float32 weights, on the demo model and on a random
    8-layer Llama built here (hidden 512). Every system gets one untimed warm-up run first; our
    prefix cache is reset before each repeat so nothing is reused between repeats.
(b) Our time to first token for a prompt behind a 1,800-token shared prefix: cold (the cache
    reset) vs warm (the prefix computed by the request before), on the demo model.
(c) Our total time vs the naive loop that recomputes the whole sequence at every step
    (`EngineConfig(enable_kv_cache=False)`) for a 2,000-token prompt and 300 output tokens. The
    demo model's context is 2,048 positions, so this uses a random Llama with the demo model's
    shapes and a 4,096-position context, built here. The naive loop takes minutes; it runs
    `--naive-repeats` times (default 1).

Times are medians over `--repeats` runs (default 3); ratios compare the medians.

    .venv/bin/python benchmarks/engine_throughput.py [--threads 1] [--repeats 3] [--sections abc]
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, GenerationConfig  # noqa: E402

from kvscope.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from kvscope.engine.models.load import load_model, resolve_model  # noqa: E402

try:
    from transformers import ContinuousBatchingConfig
except ImportError:  # where 5.x keeps it
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

DEMO_SHAPES = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=32)
BIGGER_SHAPES = dict(vocab_size=2048, hidden_size=512, intermediate_size=1536,
                     num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                     head_dim=64)
PAD, BOS, EOS = 2, 0, 1


def build_random_llama(folder: Path, shapes: dict, max_positions: int, seed: int = 0) -> Path:
    config = transformers.LlamaConfig(**shapes, max_position_embeddings=max_positions,
                                      tie_word_embeddings=True, rms_norm_eps=1e-5,
                                      bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
                                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def random_ids(n: int, rng: random.Random, vocab: int = 2048) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def median(xs):
    return statistics.median(xs)


def hf_model(path: Path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# ------------------------------------------------------------------------------------ (a)
def ours_generate(engine: Engine, prompts, max_new: int):
    engine.reset_prefix_cache()
    hits = engine.snapshot().hit_tokens
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_new, ignore_eos=True))
    assert engine.snapshot().hit_tokens == hits, "a repeat reused cached blocks"
    assert all(len(o.token_ids) == max_new for o in outs)
    return [o.token_ids for o in outs]


def hf_generate(model, prompts, max_new: int):
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, pad_token_id=PAD)
    return out[:, width:].tolist()


def hf_generate_batch(model, prompts, max_new: int):
    gen = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                           pad_token_id=PAD)
    # Sized explicitly: on the CPU its automatic sizing allocates for minutes of work (37 s for
    # this job with the defaults, measured). 32 pages of 256 tokens hold the whole batch.
    cb = ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=1024)
    with torch.inference_mode():
        res = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    outs = [r.generated_tokens for r in res.values()]
    assert len(outs) == len(prompts) and all(len(o) == max_new for o in outs)
    return outs


def section_a(args, models: dict[str, Path]) -> None:
    rng = random.Random(1)
    prompts = [random_ids(64 + 6 * i, rng) for i in range(16)]
    max_new = args.output_tokens
    total_out = len(prompts) * max_new
    print(f"\n(a) output-token throughput: {len(prompts)} prompts of {len(prompts[0])}.."
          f"{len(prompts[-1])} tokens, {max_new} greedy output tokens each (EOS ignored), "
          f"float32, median of {args.repeats}")
    for name, path in models.items():
        engine = Engine(load_model(path), EngineConfig())
        model = hf_model(path)
        systems = {
            "kvscope engine": lambda e=engine: ours_generate(e, prompts, max_new),
            "transformers generate()": lambda m=model: hf_generate(m, prompts, max_new),
            "transformers generate_batch()": lambda m=model: hf_generate_batch(m, prompts,
                                                                                max_new),
        }
        results = {k: fn() for k, fn in systems.items()}  # warm-up, untimed
        times = {k: [] for k in systems}
        for _ in range(args.repeats):  # interleaved, so drift hits every system alike
            for k, fn in systems.items():
                times[k].append(timed(fn)[0])
        nparams = sum(p.numel() for p in model.parameters())
        print(f"\n  model: {name} ({nparams / 1e6:.1f} M parameters, "
              f"{model.config.num_hidden_layers} layers, hidden {model.config.hidden_size})")
        print(f"  {'system':<32}{'median s':>10}{'output tok/s':>15}{'time / ours':>13}")
        ours = median(times["kvscope engine"])
        for k, ts in times.items():
            m = median(ts)
            print(f"  {k:<32}{m:>10.3f}{total_out / m:>15.1f}{m / ours:>12.2f}x")
        same = sum(a == b for a, b in zip(results["kvscope engine"],
                                          results["transformers generate()"], strict=True))
        same_cb = sum(a == b for a, b in zip(results["kvscope engine"],
                                             results["transformers generate_batch()"],
                                             strict=True))
        print(f"  greedy outputs identical to ours: generate() {same}/{len(prompts)} prompts, "
              f"generate_batch() {same_cb}/{len(prompts)}")
        del engine, model


# ------------------------------------------------------------------------------------ (b)
def section_b(args, demo: Path) -> None:
    rng = random.Random(2)
    prefix = [BOS] + random_ids(1799, rng)
    engine = Engine(load_model(demo), EngineConfig())
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.generate([random_ids(200, rng)], params)  # warm-up
    cold, warm, cached = [], [], []
    for _ in range(max(args.repeats, 3)):
        engine.reset_prefix_cache()
        (a,) = engine.generate([prefix + random_ids(48, rng)], params)
        (b,) = engine.generate([prefix + random_ids(48, rng)], params)
        assert a.num_cached_tokens == 0
        cold.append(a.metrics.ttft_s)
        warm.append(b.metrics.ttft_s)
        cached.append(b.num_cached_tokens)
    c, w = median(cold), median(warm)
    print(f"\n(b) time to first token, {len(prefix)}-token shared prefix + 48-token question, "
          f"demo model, block size {engine.config.block_size}, "
          f"{engine.config.max_num_batched_tokens} tokens per step, median of {len(cold)}")
    print(f"  cold (cache reset):            {c * 1e3:8.1f} ms   "
          f"(all {len(prefix) + 48} prompt tokens computed)")
    print(f"  warm (prefix cached):          {w * 1e3:8.1f} ms   "
          f"({cached[0]} tokens from the cache, {len(prefix) + 48 - cached[0]} computed)")
    print(f"  cold / warm:                   {c / w:8.1f}x")


# ------------------------------------------------------------------------------------ (c)
def section_c(args, long_model: Path) -> None:
    rng = random.Random(3)
    prompt = [BOS] + random_ids(1999, rng)
    n_out = args.naive_output_tokens
    params = SamplingParams(max_tokens=n_out, ignore_eos=True)
    print(f"\n(c) KV cache vs the naive loop: a {len(prompt)}-token prompt, {n_out} output "
          "tokens, random Llama with the demo model's shapes and a 4,096-position context")
    cached = Engine(load_model(long_model), EngineConfig())
    cached.generate([random_ids(100, rng)], SamplingParams(max_tokens=4))  # warm-up
    ours, out_ours = [], None
    for _ in range(args.repeats):
        cached.reset_prefix_cache()
        dt, outs = timed(lambda: cached.generate([prompt], params))
        ours.append(dt)
        out_ours = outs[0].token_ids
    naive = Engine(load_model(long_model), EngineConfig(enable_kv_cache=False))
    naive.generate([random_ids(100, rng)], SamplingParams(max_tokens=4))  # warm-up
    slow, out_naive = [], None
    for _ in range(args.naive_repeats):
        dt, outs = timed(lambda: naive.generate([prompt], params))
        slow.append(dt)
        out_naive = outs[0].token_ids
    o, n = median(ours), median(slow)
    steps = naive.step_records[-n_out:]
    print(f"  {'with the KV cache, median of ' + str(len(ours)):<34}{o:8.2f} s")
    print(f"  {'naive loop, median of ' + str(len(slow)):<34}{n:8.2f} s   (median step "
          f"{median(s.wall_s for s in steps) * 1e3:.0f} ms, each recomputing "
          f"{len(prompt)}..{len(prompt) + n_out - 1} tokens)")
    print(f"  {'naive / cached':<34}{n / o:8.1f}x")
    same = sum(a == b for a, b in zip(out_ours, out_naive, strict=True))
    print(f"  greedy tokens identical: {same}/{n_out}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--naive-repeats", type=int, default=1)
    p.add_argument("--output-tokens", type=int, default=64, help="(a): per prompt")
    p.add_argument("--naive-output-tokens", type=int, default=300, help="(c)")
    p.add_argument("--sections", default="abc")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    print(f"engine_throughput: torch {torch.__version__} ({torch.get_num_threads()} intra-op "
          f"threads, {torch.get_num_interop_threads()} inter-op), transformers "
          f"{transformers.__version__}, Python {platform.python_version()}, "
          f"{platform.machine()}, {os.cpu_count()} CPUs, device cpu")
    print("command: " + " ".join([Path(sys.executable).name, *sys.argv]))
    demo = resolve_model("demo")
    with tempfile.TemporaryDirectory(prefix="kvscope-bench-") as tmp:
        if "a" in args.sections:
            bigger = build_random_llama(Path(tmp) / "bigger", BIGGER_SHAPES, 2048)
            section_a(args, {"demo (trained, resources/demo)": demo,
                             "random Llama, 8 layers (built here)": bigger})
        if "b" in args.sections:
            section_b(args, demo)
        if "c" in args.sections:
            section_c(args, build_random_llama(Path(tmp) / "long", DEMO_SHAPES, 4096))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
