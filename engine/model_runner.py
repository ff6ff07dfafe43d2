"""Runs packed forward passes of a loaded model over one paged KV tensor.

The runner knows nothing about requests or scheduling: the caller (the scheduler, or a test)
decides which tokens to compute, at which positions, and in which physical blocks.

fp8 caches: each layer has a python-float ``k_scale`` and ``v_scale``; the cache stores
``x / scale`` saturated to the e4m3 range (+-448). The default scale is 1.0 (vLLM's default
without calibrated checkpoint scales): it is history-independent, so a prompt's KV never
depends on which prompts ran before. ``calibrate_kv_scales`` sets per-layer scales from the
|k|/|v| maxima of sample prompts instead; call it before anything is stored. ``fp8_per_head``:
the same with a ``[kv_heads, 1]`` tensor per layer (per head maxima).

Formats with scales beside the block (kvscope.kernels.kv_formats): ``kv_meta`` holds them, each
tensor ``[slices, sides, num_blocks, ...]``, copied with the data wherever a block is copied
(copy-on-write, the host tier); KIVI's per-sequence residual is ``residual``
(kvscope.engine.kivi_residual).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from kvscope import kernels
from kvscope.engine.kivi_residual import KiviResidual
from kvscope.engine.kv_groups import NULL, KVGroup, groups_of
from kvscope.engine.models.attention import AttentionContext
from kvscope.engine.models.llama import Linear
from kvscope.engine.models.load import LoadedModel
from kvscope.kernels import kv_formats
from kvscope.kernels.kv_quant import PackedSide

FP8_HEADROOM = 2.0  # calibrated scale maps 2x the observed max to 448


@dataclass
class SeqChunk:
    """One sequence's share of a forward pass."""

    token_ids: list[int]     # the new tokens to compute (prompt chunk, or 1 decode token)
    start_pos: int           # tokens of this sequence already in the paged KV
    block_table: list[int]   # physical blocks covering positions 0 .. start_pos+len-1
    want_logits: bool = True  # return logits for the last new token
    # The block tables of KV-cache groups 1.. (block_table is group 0's); NULL (-1) for a block
    # a sliding window released (never one the new tokens are written to)
    more_tables: tuple[list[int], ...] = ()


def available_memory(device: torch.device) -> int:
    """Bytes a new tensor can take now: free device memory on CUDA, available RAM elsewhere."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        import psutil
    except ImportError:  # (not on every machine the GPU check runs on): Linux's own estimate
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    return psutil.virtual_memory().available


def check_pool_fits(num_blocks: int, block_size: int, bytes_per_token: float,
                    device: torch.device, what: str = "the KV pool", extra: int = 0) -> None:
    """Refuse, before allocating, a KV pool (or host tier) larger than the memory there is;
    ``extra``: bytes beside it (KIVI's residual)."""
    need = int(num_blocks * block_size * bytes_per_token) + extra
    have = available_memory(device)
    if need > have:
        raise ValueError(
            f"{what} needs {_gib(need)} ({num_blocks} blocks x {block_size} tokens x "
            f"{bytes_per_token} bytes per token) but only {_gib(have)} of "
            f"{'GPU memory is free' if device.type == 'cuda' else 'memory is available'}: "
            "use fewer blocks or a smaller block size")


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**27 else f"{n / 2**20:,.1f} MiB"


@dataclass
class ForwardBatch:
    """Device inputs of one packed forward pass, built on the host from the chunks."""

    input_ids: torch.Tensor   # int64 [T]
    positions: torch.Tensor   # int64 [T]
    ctx: AttentionContext
    logit_rows: torch.Tensor  # int64: the rows of the chunks that want logits


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int,
                 kv_cache_dtype: str = "auto", device: str | torch.device = "cpu",
                 kernel_impl: str | None = None, prepack_cpu_weights: bool = False,
                 groups: tuple[KVGroup, ...] | None = None, max_num_seqs: int = 64,
                 kivi_group: int | None = None):
        """``kernel_impl``: None picks triton on CUDA and torch elsewhere; "torch" or "triton"
        forces one (triton on the CPU needs ``TRITON_INTERPRET=1``, for tests).
        ``prepack_cpu_weights``: see ``EngineConfig`` (``prepacked_weight_bytes`` counts it).
        ``groups``: the KV-cache groups (default: the model's, from its layers' windows). Layer
        i of a group uses the group's block tables and slice i of the KV tensor, which the
        groups share (a block is in one group's table at a time): the tensor has as many
        slices as the largest group has layers. ``max_num_seqs``: KIVI's residual slots (one
        per running sequence); ``kivi_group``: its K group (default: kv_formats')."""
        self.device = torch.device(device)
        self.kernels = kernels.kernel_backend(kernel_impl, self.device)
        self.model = loaded.model.to(self.device)
        if self.device.type == "cpu":
            kernels.hugepage_weights(self.model)
        for module in self.model.modules():
            if isinstance(module, Linear):
                module.prepack = prepack_cpu_weights and self.device.type == "cpu"
        if not prepack_cpu_weights:
            kernels.cpu.drop_packed(self.model)
        self.config = cfg = loaded.config
        self.model_dtype = loaded.dtype
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.format = fmt = kv_formats.kv_format(kv_cache_dtype, block_size, kivi_group)
        kv_formats.check_shape(fmt, cfg.head_dim)
        self.cache_dtype = fmt.data_dtype(self.model_dtype)
        self.groups = groups or groups_of(cfg.layer_windows)
        self.num_slices = slices = self._assign_groups()
        self.kv_bytes_per_block = slices * round(block_size * fmt.bytes_per_token(
            cfg.num_kv_heads, cfg.head_dim, self.model_dtype.itemsize))
        per_token = self.kv_bytes_per_block / block_size
        self.kv_bytes_per_token = int(per_token) if per_token.is_integer() else per_token
        self.residual = None
        if fmt.scheme == "kivi":
            self.residual = KiviResidual(slices, max_num_seqs, fmt.group, cfg.num_kv_heads,
                                         cfg.head_dim, self.model_dtype, self.device)
        check_pool_fits(num_blocks, block_size, self.kv_bytes_per_token, self.device,
                        extra=self.residual_bytes)
        if self.is_fp8 and self.kernels.name == "triton":
            kernels.check_fp8_support(self.device)
        self.kv_cache, self.kv_meta = self._allocate(num_blocks, self.device)
        self.host_kv: torch.Tensor | None = None  # the host tier's KV (add_host_tier)
        self.host_meta: tuple[torch.Tensor, ...] = ()
        one = (lambda: torch.ones(cfg.num_kv_heads, 1, device=self.device)) \
            if fmt.scheme == "fp8_per_head" else (lambda: 1.0)
        self.k_scales = [one() for _ in range(cfg.num_layers)]
        self.v_scales = [one() for _ in range(cfg.num_layers)]
        self._stored_any = False

    def _allocate(self, num_blocks: int, device: torch.device, pin: bool = False):
        cfg, fmt = self.config, self.format
        shape = (self.num_slices, 2, num_blocks, self.block_size, cfg.num_kv_heads,
                 fmt.packed_dim(cfg.head_dim))
        if device.type == "cpu" and not pin:
            data = kernels.cpu.zeros(shape, self.cache_dtype)
        else:
            data = torch.zeros(shape, dtype=self.cache_dtype, device=device, pin_memory=pin)
        meta = tuple(torch.zeros((self.num_slices, sides, num_blocks, *rest), dtype=dtype,
                                 device=device, pin_memory=pin)
                     for rest, sides, dtype in fmt.meta_shapes(self.block_size, cfg.num_kv_heads,
                                                               cfg.head_dim))
        return data, meta

    @property
    def residual_bytes(self) -> int:
        """KIVI's per-sequence full-precision K (all slots), beside the pool; else 0."""
        return 0 if self.residual is None else self.residual.nbytes

    def _assign_groups(self) -> int:
        """Tell each layer its group and KV slice; returns the number of slices."""
        layers = self.model.model.layers
        for g, group in enumerate(self.groups):
            for i, layer in enumerate(group.layers or range(len(layers))):
                attn = layers[layer].self_attn.attn
                attn.group, attn.cache_index = g, i
        return max(len(g.layers) or len(layers) for g in self.groups)

    @property
    def weight_bytes(self) -> int:
        """The model's parameters (tied ones once): what a decode step reads. The prepacked
        copies are ``prepacked_weight_bytes``."""
        seen, total = set(), 0
        for p in self.model.parameters():
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
        return total

    @property
    def prepacked_weight_bytes(self) -> int:
        """Bytes of the oneDNN-blocked weight copies for CPU prefill (``prepack_cpu_weights``);
        they are made on first use, so 0 before the first prefill."""
        return kernels.cpu.packed_bytes(self.model)

    @property
    def is_fp8(self) -> bool:
        return self.cache_dtype == torch.float8_e4m3fn

    def add_host_tier(self, num_blocks: int) -> None:
        """The host tier's KV: `num_blocks` blocks in host memory (pinned on CUDA), the layout of
        the device's, scales and zero points included (see `transfer`)."""
        bytes_per_token = self.kv_bytes_per_token
        check_pool_fits(num_blocks, self.block_size, bytes_per_token, torch.device("cpu"),
                        "the host tier")
        self.host_kv, self.host_meta = self._allocate(num_blocks, torch.device("cpu"),
                                                      pin=self.device.type == "cuda")

    @torch.inference_mode()
    def transfer(self, offloads: Sequence[tuple[int, int]], loads: Sequence[tuple[int, int]]
                 ) -> None:
        """The host tier's copies, before a step's forward pass: offloads (device block ->
        host block) first, as they read device blocks that loads may overwrite, then loads
        (host block -> device block). Every layer's K and V of each block."""
        pairs = list(zip((self.kv_cache, *self.kv_meta), (self.host_kv, *self.host_meta),
                         strict=True))
        if offloads:
            src, dst = (torch.tensor(x, dtype=torch.int64) for x in zip(*offloads, strict=True))
            for dev, host in pairs:
                host[:, :, dst] = dev[:, :, src.to(dev.device)].to("cpu")
        if loads:
            src, dst = (torch.tensor(x, dtype=torch.int64) for x in zip(*loads, strict=True))
            for dev, host in pairs:
                dev[:, :, dst.to(dev.device)] = host[:, :, src].to(dev.device, non_blocking=True)

    @torch.inference_mode()
    def run(self, chunks: Sequence[SeqChunk], copies: Sequence[tuple[int, int]] = ()
            ) -> torch.Tensor:
        """Block copies (src -> dst) first, then one packed forward over all chunks.

        Returns float32 logits ``[number of chunks with want_logits, vocab]`` in chunk order.
        """
        if copies:
            pairs = [(int(s), int(d)) for s, d in copies]
            for layer in self.kv_cache:
                kernels.copy_blocks(layer[0], layer[1], pairs)
            if self.kv_meta:
                src, dst = (kernels.to_device(torch.tensor(x), self.device)
                            for x in zip(*pairs, strict=True))
                for meta in self.kv_meta:
                    meta[:, :, dst] = meta[:, :, src]
            if self.residual is not None:
                self.residual.copy(pairs)
        if self.residual is not None:
            self.residual.drop_freed()
        if not chunks:
            return torch.empty(0, self.config.vocab_size, device=self.device)
        batch = self.prepare(chunks)
        hidden = self.model(batch.input_ids, batch.positions, batch.ctx)
        self._stored_any = True
        return self.model.compute_logits(hidden[batch.logit_rows]).float()

    def prepare(self, chunks: Sequence[SeqChunk]) -> ForwardBatch:
        """Pack ``chunks`` on the host and send them to the device without a host sync."""
        bs, num_groups = self.block_size, len(self.groups)
        ids: list[int] = []
        positions = []
        slots: list[list[torch.Tensor]] = [[] for _ in range(num_groups)]
        tables: list[list[torch.Tensor]] = [[] for _ in range(num_groups)]
        seq_lens, ctx_lens = [], []
        for c in chunks:
            n, end = len(c.token_ids), c.start_pos + len(c.token_ids)
            self._check_chunk(c, n, end)
            pos = torch.arange(c.start_pos, end)
            ids.extend(c.token_ids)
            positions.append(pos)
            for g, block_table in enumerate((c.block_table, *c.more_tables)):
                table = torch.tensor(block_table, dtype=torch.int64)
                slots[g].append(table[pos // bs] * bs + pos % bs)
                tables[g].append(table.clamp_(min=0))  # a NULL is never read (out of window)
            seq_lens.append(n)
            ctx_lens.append(end)

        block_tables = [torch.nn.utils.rnn.pad_sequence(t, batch_first=True, padding_value=0)
                        for t in tables]
        cu_seqlens = [0, *accumulate(seq_lens)]
        logit_rows = [cu_seqlens[i + 1] - 1 for i, c in enumerate(chunks) if c.want_logits]
        dev = self.device

        def up(values, dtype=torch.int64) -> torch.Tensor:
            host = values if isinstance(values, torch.Tensor) else torch.tensor(values)
            return kernels.to_device(host.to(dtype), dev)

        ctx = AttentionContext(
            seq_lens_q=seq_lens,
            max_seqlen_q=max(seq_lens),
            max_seqlen_k=max(ctx_lens),
            cu_seqlens_q=up(cu_seqlens, torch.int32),
            kv_cache=self.kv_cache,
            slot_mapping=up(torch.cat(slots[0])),
            block_tables=up(block_tables[0], torch.int32),
            more_groups=[(up(t, torch.int32), up(torch.cat(s)))
                         for t, s in zip(block_tables[1:], slots[1:], strict=True)] or None,
            context_lens=up(ctx_lens, torch.int32),
            is_decode=all(n == 1 for n in seq_lens),
            k_scales=self.k_scales,
            v_scales=self.v_scales,
            kernels=self.kernels,
            kv_sides=self._sides(chunks) if self.format.is_packed else None,
        )
        return ForwardBatch(up(ids), up(torch.cat(positions)), ctx, up(logit_rows))

    def _sides(self, chunks: Sequence[SeqChunk]):
        """The per-layer ``PackedSide`` pair a layer passes to the kernels in place of scales:
        ``(cache_index, group) -> (k_side, v_side)``."""
        fmt, plans = self.format, None
        if self.residual is not None:
            plans = [self.residual.plan([(t, c.start_pos, c.start_pos + len(c.token_ids))
                                         for c, t in zip(chunks, tables, strict=True)],
                                        self.block_size, self.device)
                     for tables in zip(*((c.block_table, *c.more_tables) for c in chunks),
                                       strict=True)]

        def sides(index: int, group: int) -> tuple[PackedSide, PackedSide]:
            k, v = self.side_meta(index, 0), self.side_meta(index, 1)
            if plans is None:
                return PackedSide(fmt, False, k), PackedSide(fmt, True, v)
            return (PackedSide(fmt, False, k, self.residual.k[index], plans[group]),
                    PackedSide(fmt, True, v))
        return sides

    def side_meta(self, index: int, side: int) -> tuple[torch.Tensor, ...]:
        """KV slice `index`'s tensors beside the blocks for K (side 0) or V (1), block index
        first: a PackedSide's meta (KIVI: K's per-channel and V's per-token, for both sides)."""
        meta = self.kv_meta
        if self.format.scheme == "kivi":
            return meta[0][index, 0], meta[1][index, 0]
        return (meta[0][index, side],)

    def _check_chunk(self, c: SeqChunk, n: int, end: int) -> None:
        if n == 0:
            raise ValueError("a SeqChunk needs at least one new token")
        if c.start_pos < 0:
            raise ValueError(f"negative start_pos {c.start_pos}")
        if len(c.more_tables) != len(self.groups) - 1:
            raise ValueError(f"the model has {len(self.groups)} KV-cache groups: a SeqChunk "
                             f"needs {len(self.groups) - 1} more block tables, got "
                             f"{len(c.more_tables)}")
        for table in (c.block_table, *c.more_tables):
            if len(table) * self.block_size < end:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {end} "
                                 f"tokens (block_size {self.block_size})")
            if any(not 0 <= b < self.num_blocks for b in table if b != NULL):
                raise ValueError(f"block id out of range [0, {self.num_blocks}) in {table}")
            if NULL in table[c.start_pos // self.block_size:]:
                raise ValueError(f"a null block where new tokens go, in {table}")

    @torch.inference_mode()
    def run_naive(self, token_id_lists: Sequence[Sequence[int]]) -> torch.Tensor:
        """No-KV-cache baseline: recompute each whole sequence with plain causal attention.

        Returns float32 last-token logits ``[batch, vocab]``.
        """
        return self._naive_forward(token_id_lists, None)

    def _naive_forward(self, token_id_lists, kv_amax: list | None) -> torch.Tensor:
        seq_lens = [len(t) for t in token_id_lists]
        if any(n == 0 for n in seq_lens):
            raise ValueError("run_naive needs non-empty token lists")
        dev = self.device
        ids = torch.tensor([t for seq in token_id_lists for t in seq], dtype=torch.int64)
        positions = torch.cat([torch.arange(n) for n in seq_lens])
        ctx = AttentionContext(seq_lens_q=seq_lens, max_seqlen_q=max(seq_lens),
                               max_seqlen_k=max(seq_lens), kv_amax=kv_amax)
        hidden = self.model(kernels.to_device(ids, dev), kernels.to_device(positions, dev), ctx)
        last = kernels.to_device(torch.tensor(list(accumulate(seq_lens))) - 1, dev)
        return self.model.compute_logits(hidden[last]).float()

    def scale_kv(self, factor: float) -> None:
        """Every fp8 K and V scale times `factor` (from 1.0: the scale given); before anything
        is stored."""
        if not self.is_fp8:
            raise ValueError("kv scales only apply to an fp8 cache")
        if self._stored_any:
            raise RuntimeError("kv scales must be set before anything is stored")
        self.k_scales = [s * factor for s in self.k_scales]
        self.v_scales = [s * factor for s in self.v_scales]

    @torch.inference_mode()
    def calibrate_kv_scales(self, token_id_lists: Sequence[Sequence[int]]) -> None:
        """Set per-layer fp8 scales to ``FP8_HEADROOM * amax / 448`` measured on the sample
        (``fp8_per_head``: per layer and KV head).

        Only for fp8 caches and only before the first ``run`` (stored blocks would otherwise
        be read back with the wrong scale).
        """
        if self.format.scheme not in ("fp8", "fp8_per_head"):
            raise ValueError("kv scales only apply to an fp8 cache")
        if self._stored_any:
            raise RuntimeError("calibrate_kv_scales must run before anything is stored")
        per_layer: list[torch.Tensor] = []
        self._naive_forward(token_id_lists, per_layer)
        amax = torch.stack(per_layer).float()  # [layers, 2 (K, V), kv_heads]
        scales = amax.clamp_min(1e-6) * FP8_HEADROOM / kernels.FP8_MAX
        if self.format.scheme == "fp8_per_head":
            self.k_scales = [s[:, None].to(self.device) for s in scales[:, 0]]
            self.v_scales = [s[:, None].to(self.device) for s in scales[:, 1]]
        else:  # one transfer for all layers
            self.k_scales, self.v_scales = scales.amax(-1).T.tolist()


def blocks_that_fit(loaded, block_size: int, kv_cache_dtype: str, device: torch.device,
                    fraction: float) -> int:
    """KV blocks that `fraction` of the GPU's free memory holds (the engine's default pool)."""
    probe = ModelRunner(loaded, 1, block_size, kv_cache_dtype, device)
    free, _ = torch.cuda.mem_get_info(device)
    per_block = probe.kv_bytes_per_block
    del probe
    return max(1, int(free * fraction) // per_block)
