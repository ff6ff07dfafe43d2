"""fp8: an fp8 KV cache halves the bytes per token (so doubles capacity); how far do greedy
tokens agree with a 16-bit cache."""

from __future__ import annotations

from kvscope.lab.capacity import KVShape, kv_bytes_per_token
from kvscope.lab.experiments.fit import ratio
from kvscope.lab.experiments.result import Result

NAME = "fp8"
CLAIM = ("An fp8 KV cache halves the bytes per token, so the same memory holds twice the "
         "tokens, at a small cost in accuracy (greedy tokens mostly agree).")


def agreement(a: list[int], b: list[int]) -> tuple[int, int | None]:
    """(positions where the tokens agree, index of the first difference or None)."""
    same = sum(x == y for x, y in zip(a, b, strict=False))
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return same, first


def max_logit_deviation(bench, prompt: list[int], tokens: list[int]) -> float:
    """The largest |logit difference| between an fp8 and a 16-bit cache over the steps, both
    fed the 16-bit run's tokens (so every step sees the same context)."""
    half = bench.forced("bfloat16", [prompt], [tokens]).logits[0]
    fp8 = bench.forced("fp8", [prompt], [tokens]).logits[0]
    bench.advance()
    return float((half - fp8).abs().max())


def measure(bench, quick: bool = False) -> Result:
    n_prompts, prompt_len, out = (2, 16, 8) if quick else (8, 128, 64)
    prompts = [bench.prompt(prompt_len, seed=i) for i in range(n_prompts)]
    shape = KVShape.from_model_config(bench.model_config)
    bench.plan(2 + n_prompts)
    tokens = {}
    for dtype in ("bfloat16", "fp8"):
        outputs, _ = bench.run(bench.engine(kv_cache_dtype=dtype), prompts, out)
        tokens[dtype] = [o.token_ids for o in outputs]
    rows = []
    for i, (a, b) in enumerate(zip(tokens["bfloat16"], tokens["fp8"], strict=True)):
        same, first = agreement(a, b)
        rows.append([i, len(a), same, -1 if first is None else first,
                     max_logit_deviation(bench, prompts[i], a)])
    return summarize(rows, kv_bytes_per_token(shape, "bfloat16"), kv_bytes_per_token(shape, "fp8"))


def summarize(rows, bytes16: int, bytes8: int) -> Result:
    same, total = sum(r[2] for r in rows), sum(r[1] for r in rows)
    identical = sum(r[3] == -1 for r in rows)
    verdict = (f"KV bytes per token {bytes16} (16-bit) -> {bytes8} (fp8): capacity "
               f"{ratio(bytes16, bytes8):.1f}x (claimed 2x); greedy tokens agree at "
               f"{same}/{total} positions ({100 * ratio(same, total):.0f} %), {identical}/"
               f"{len(rows)} prompts identical; largest logit deviation "
               f"{max(r[4] for r in rows):.3g}")
    return Result(NAME, CLAIM, ["prompt", "tokens", "agreeing", "first difference",
                                "max |logit diff|"], rows, verdict, x="prompt",
                  ys=["agreeing", "max |logit diff|"])
