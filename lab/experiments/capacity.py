"""capacity: fill a pool of a fixed memory budget with requests of one shape until it
preempts, in every KV-cache format; measured concurrency and the engine's own bytes against
the formula."""

from __future__ import annotations

from dataclasses import replace

from kvscope.lab.capacity import FORMATS, KVShape, format_residual_bytes, kv_bytes_per_token
from kvscope.lab.experiments.fit import blocks_per_request, ratio, requests_that_fit_in_blocks
from kvscope.lab.experiments.result import Result

NAME = "capacity"
CLAIM = ("KV bytes per token = 2 x layers x KV heads x head dim x bytes per element (128 KiB for "
         "Llama 3.1 8B in 16-bit), plus the scales and zero points a quantized format keeps "
         "beside its values (KIVI: and a full-precision K residual per running request); a "
         "pool's capacity in tokens and in concurrent requests follows, and fp8 doubles it.")
BLOCK_SIZE = 16
MAX_NUM_SEQS = 256


def pool_blocks(budget_bytes: float, bytes_per_token: float, block_size: int = BLOCK_SIZE) -> int:
    return int(budget_bytes // (bytes_per_token * block_size))


def engine_bytes(engine) -> tuple[float, int]:
    """The engine's KV tensors, measured: (bytes per pool token, scales and zero points
    included; KIVI residual bytes per running-sequence slot)."""
    r = engine.runner
    pool = sum(t.numel() * t.element_size() for t in (r.kv_cache, *r.kv_meta))
    per_token = pool / (engine.num_blocks * engine.config.block_size)
    return (int(per_token) if per_token.is_integer() else per_token,
            r.residual_bytes // engine.config.max_num_seqs)


def plan(shape: KVShape, budget: float, context: int) -> list[tuple]:
    """Per format: (label, kv_cache_dtype, bytes per token, residual per request, pool blocks,
    requests that fit). KIVI's residual per running request comes out of the same budget:
    requests that fit = floor(budget / (the request's blocks' bytes + its residual))."""
    rows = []
    for label, fmt in FORMATS:
        per_token = kv_bytes_per_token(shape, fmt, BLOCK_SIZE)
        residual = format_residual_bytes(shape, fmt, BLOCK_SIZE)
        if residual:
            held = blocks_per_request(context, BLOCK_SIZE) * BLOCK_SIZE * per_token
            fit = int(budget // (held + residual))
            blocks = pool_blocks(budget - fit * residual, per_token)
        else:
            blocks = pool_blocks(budget, per_token)
            fit = requests_that_fit_in_blocks(blocks, context, BLOCK_SIZE)
        rows.append((label, fmt, per_token, residual, blocks, fit))
    return rows


def measure(bench, quick: bool = False) -> Result:
    prompt_len, out, budget_tokens = (24, 8, 256) if quick else (96, 32, 2048)
    # the dtype the model runs in (its checkpoint's may differ): KIVI's residual is kept in it
    shape = replace(KVShape.from_model_config(bench.model_config), dtype=str(bench.loaded.dtype))
    budget = budget_tokens * kv_bytes_per_token(shape, "bfloat16")
    bench.plan(len(FORMATS))
    rows = []
    for label, fmt, per_token, residual, blocks, fit in plan(shape, budget, prompt_len + out):
        # KIVI keeps a residual slot per running sequence: as many slots as requests fit
        engine = bench.engine(kv_cache_dtype=fmt, num_blocks=blocks, block_size=BLOCK_SIZE,
                              max_num_seqs=max(1, fit) if residual else MAX_NUM_SEQS,
                              max_num_batched_tokens=4096, enable_prefix_caching=False)
        measured, measured_residual = engine_bytes(engine)
        held = measured * blocks * BLOCK_SIZE + measured_residual * engine.config.max_num_seqs
        prompts = [bench.prompt(prompt_len, seed=i) for i in range(3 * fit + 2)]
        outputs, records = bench.run(engine, prompts, out)
        first_preempt = next((r.step for r in records if r.num_preempted), None)
        rows.append([label, round(per_token, 2), residual, blocks, blocks * BLOCK_SIZE,
                     round(measured, 2), measured_residual, round(held), fit,
                     max((r.num_running for r in records), default=0),
                     sum(r.num_preempted for r in records),
                     -1 if first_preempt is None else first_preempt,
                     sum(o.finish_reason == "rejected" for o in outputs)])
    return summarize(rows, budget, prompt_len + out)


COLUMNS = ["format", "KV bytes/token", "residual/request", "pool blocks", "pool tokens",
           "engine bytes/token", "engine residual/request", "engine KV bytes",
           "formula requests", "max running", "preemptions", "first preemption step",
           "rejected"]


def summarize(rows, budget: float, context: int) -> Result:
    col = {name: i for i, name in enumerate(COLUMNS)}
    half = next(r for r in rows if r[0] == "16-bit")

    def one(r) -> str:
        residual = r[col["residual/request"]]
        return (f"{r[0]} {r[col['KV bytes/token']]:,} B/token"
                + (f" + {residual:,} B residual/request" if residual else "")
                + f" -> {r[col['pool tokens']]:,} tokens "
                f"({ratio(r[col['pool tokens']], half[col['pool tokens']]):.2f}x), formula "
                f"{r[col['formula requests']]}, measured up to {r[col['max running']]} running")

    off = [r[0] for r in rows if (r[col["engine bytes/token"]], r[col["engine residual/request"]])
           != (r[col["KV bytes/token"]], r[col["residual/request"]])]
    verdict = (f"in {budget / 1024:,.0f} KiB of KV memory, {context}-token requests: "
               + "; ".join(one(r) for r in rows)
               + (f"; the engine's tensors differ from the formula in {', '.join(off)}" if off
                  else "; the engine's tensors hold the formula's bytes in every format"))
    return Result(NAME, CLAIM, COLUMNS, rows, verdict, x="format",
                  ys=["formula requests", "max running"])
