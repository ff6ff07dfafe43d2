"""Teacher-forced runs of a KV format for the kv-formats lab: every prompt batched on a model
runner of its own, the format on both sides or on one only (K or V; the other kept in the model's
dtype, to tell K's error from V's), and what the cache holds read back per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscope.engine.kv_groups import groups_of
from kvscope.engine.model_runner import ModelRunner, SeqChunk
from kvscope.kernels import reference
from kvscope.kernels.kv_quant import PackedSide, read_blocks

SIDES = ("kv", "k", "v")  # which sides hold the format


class SideRunner(ModelRunner):
    """The format on the `quantized` side only ("k" or "v"): the other side's cache is a tensor
    in the model's dtype. Torch kernels (the reference reads each side as its scale says)."""

    def __init__(self, loaded, num_blocks: int, block_size: int, kv_cache_dtype: str, device,
                 quantized: str):
        super().__init__(loaded, num_blocks, block_size, kv_cache_dtype, device,
                         kernel_impl="torch")
        cfg = self.config
        shape = (self.num_slices, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        kept = torch.zeros(shape, dtype=self.model_dtype, device=self.device)
        self.kept = (1 if quantized == "k" else 0, kept)

    def prepare(self, chunks):
        batch = super().prepare(chunks)
        batch.ctx.kv_kept = self.kept
        return batch


@dataclass
class Forced:
    logits: list[torch.Tensor]  # per prompt, float32 [len(continuation), vocab]
    runner: ModelRunner
    tables: list[list[list[int]]]  # per prompt, its block table in each KV-cache group


def forced(loaded, device, kv_cache_dtype: str, prompts: list[list[int]],
           continuations: list[list[int]], sides: str = "kv", block_size: int = 16) -> Forced:
    """Logits after each prompt and after each of its continuation's tokens but the last, fed in
    turn (teacher forcing), every prompt in one batch, each in its own blocks; an fp8 format's
    scales calibrated on the prompts first. Torch kernels for every format and side, so that
    runs differ by what the cache stores only."""
    if sides not in SIDES:
        raise ValueError(f"sides must be one of {', '.join(SIDES)}, not {sides!r}")
    num_groups = len(groups_of(loaded.config.layer_windows))
    tables, start = [], 0
    for p, c in zip(prompts, continuations, strict=True):
        n = -(-(len(p) + len(c)) // block_size)
        tables.append([list(range(start + g * n, start + (g + 1) * n))
                       for g in range(num_groups)])
        start += n * num_groups
    runner = (ModelRunner(loaded, start, block_size, kv_cache_dtype, device, "torch")
              if sides == "kv" else
              SideRunner(loaded, start, block_size, kv_cache_dtype, device, sides))
    if runner.is_fp8:  # its scales from the prompts' first pass, as the engine's would be
        runner.calibrate_kv_scales(prompts)
    rows: list[list] = [[] for _ in prompts]
    feeds, done = [list(p) for p in prompts], [0] * len(prompts)
    for t in range(max(map(len, continuations))):
        live = [i for i, c in enumerate(continuations) if t < len(c)]
        logits = runner.run([SeqChunk(feeds[i], done[i], tables[i][0], True,
                                      tuple(tables[i][1:])) for i in live])
        for row, i in zip(logits, live, strict=True):
            rows[i].append(row)
            done[i] += len(feeds[i])
            feeds[i] = [continuations[i][t]]
    return Forced([torch.stack(r) for r in rows], runner, tables)


def layer_errors(run: Forced, ref: Forced, lengths: list[int]) -> list[tuple[float, float]]:
    """Per layer, the relative RMS error ||cached - reference|| / ||reference|| of K and of V
    over the whole blocks of every sequence (`lengths` tokens each), as the two runs cached them
    (a layer's error includes what earlier layers' errors did to its input)."""
    out = []
    for layer in run.runner.model.model.layers:
        attn = layer.self_attn.attn
        blocks = torch.tensor([b for t, n in zip(run.tables, lengths, strict=True)
                               for b in t[attn.group][:n // run.runner.block_size]],
                              dtype=torch.int64, device=run.runner.device)
        errors = []
        for side in (0, 1):
            got = cached(run.runner, attn, side, blocks)
            want = cached(ref.runner, attn, side, blocks)
            errors.append(float((got - want).norm() / want.norm().clamp(min=1e-30)))
        out.append((errors[0], errors[1]))
    return out


def cached(runner: ModelRunner, attn, side: int, blocks: torch.Tensor) -> torch.Tensor:
    """What the cache holds for one layer's side in whole blocks, float32."""
    kept = getattr(runner, "kept", None)
    if kept is not None and kept[0] == side:
        return kept[1][attn.cache_index].index_select(0, blocks).float()
    cache, fmt = runner.kv_cache[attn.cache_index, side], runner.format
    if fmt.is_packed:
        meta = runner.side_meta(attn.cache_index, side)
        return read_blocks(cache, blocks, PackedSide(fmt, bool(side), meta))
    scales = runner.v_scales if side else runner.k_scales
    return reference.dequantize(cache.index_select(0, blocks), scales[attn.layer_idx])
