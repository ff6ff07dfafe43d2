"""capacity: fill a pool of a fixed memory budget with requests of one shape until it
preempts; measured concurrency against the formula, at 16-bit and fp8."""

from __future__ import annotations

from kvscope.lab.capacity import (
    KVShape,
    format_bytes_per_token,
    format_residual_bytes,
    kv_bytes_per_token,
)
from kvscope.lab.experiments.fit import ratio, requests_that_fit_in_blocks
from kvscope.lab.experiments.result import Result

NAME = "capacity"
CLAIM = ("KV bytes per token = 2 x layers x KV heads x head dim x bytes per element (128 KiB for "
         "Llama 3.1 8B in 16-bit); a pool's capacity in tokens and in concurrent requests "
         "follows, and fp8 doubles it.")
# Any kv_cache_dtype can be a row (its bytes per token from kv_formats, KIVI's residual charged
# per running request); the quantized formats are compared by the kv-formats lab.
PRECISIONS = (("16-bit", "bfloat16"), ("fp8", "fp8"))
BLOCK_SIZE = 16


def pool_blocks(budget_bytes: int, bytes_per_token: float, block_size: int = BLOCK_SIZE) -> int:
    return int(budget_bytes // (bytes_per_token * block_size))


def measure(bench, quick: bool = False) -> Result:
    prompt_len, out, budget_tokens = (24, 8, 256) if quick else (96, 32, 2048)
    shape = KVShape.from_model_config(bench.model_config)
    budget = budget_tokens * kv_bytes_per_token(shape, "bfloat16")
    bench.plan(len(PRECISIONS))
    rows = []
    for label, dtype in PRECISIONS:
        per_token = format_bytes_per_token(shape, dtype, BLOCK_SIZE)
        blocks = pool_blocks(budget, per_token)
        fit = requests_that_fit_in_blocks(blocks, prompt_len + out, BLOCK_SIZE)
        residual = format_residual_bytes(shape, dtype, BLOCK_SIZE)
        if residual:  # the running requests' residuals come out of the same budget
            blocks = max(1, pool_blocks(budget - fit * residual, per_token))
            fit = requests_that_fit_in_blocks(blocks, prompt_len + out, BLOCK_SIZE)
        engine = bench.engine(kv_cache_dtype=dtype, num_blocks=blocks, block_size=BLOCK_SIZE,
                              max_num_seqs=256, max_num_batched_tokens=4096,
                              enable_prefix_caching=False)
        prompts = [bench.prompt(prompt_len, seed=i) for i in range(3 * fit + 2)]
        outputs, records = bench.run(engine, prompts, out)
        done = [r for r in records if r.num_running]
        first_preempt = next((r.step for r in records if r.num_preempted), None)
        rows.append([label, round(per_token, 2), blocks, blocks * BLOCK_SIZE, fit,
                     max(r.num_running for r in done),
                     sum(r.num_preempted for r in records),
                     -1 if first_preempt is None else first_preempt,
                     sum(o.finish_reason == "rejected" for o in outputs)])
    return summarize(rows, budget, prompt_len + out)


COLUMNS = ["precision", "KV bytes/token", "pool blocks", "pool tokens", "formula requests",
           "max running", "preemptions", "first preemption step", "rejected"]


def summarize(rows, budget: int, context: int) -> Result:
    by = {r[0]: r for r in rows}
    half, fp8 = by["16-bit"], by["fp8"]
    verdict = (f"in {budget / 1024:.0f} KiB of KV memory, {context}-token requests: 16-bit "
               f"{half[1]} B/token -> {half[3]} tokens, formula {half[4]} requests, measured up "
               f"to {half[5]} running; fp8 {fp8[1]} B/token -> {fp8[3]} tokens, formula {fp8[4]}"
               f", measured up to {fp8[5]} running ({ratio(fp8[5], half[5]):.2f}x; claimed 2x)"
               + "".join(f"; {r[0]} {r[1]} B/token -> up to {r[5]} running "
                         f"({ratio(r[5], half[5]):.2f}x)" for r in rows[2:]))
    return Result(NAME, CLAIM, COLUMNS, rows, verdict, x="precision",
                  ys=["formula requests", "max running"])
