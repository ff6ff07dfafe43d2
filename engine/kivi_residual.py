"""KIVI's full-precision residual: the K of each sequence's open group.

KIVI quantizes K per channel over a group of G tokens, so a group can only be quantized once
its G tokens are known; until then its K stays in full precision. Only a sequence's last,
partial block has an open group (G divides block_size, so a full block is all quantized: the
prefix cache, the host tier and copy-on-write of full blocks never see a residual).

Why per sequence, not per block: a per-block area would hold G - 1 tokens of full-precision K
in every block of the pool (for G = block_size, more than the quantized K itself), though only
one block per running sequence ever uses it. Here there are ``max_num_seqs`` slots of G - 1
rows, one per running sequence, lent to the block that holds its open group: a slot is taken
when a group opens, given back when it completes or when the block is freed (the pool's
``on_free``), and copied with its block on copy-on-write (a fork of a partial block). The
cost is per sequence and counted so (``KVFormat.residual_bytes``, the runner's
``residual_bytes``), not spread over the pool's tokens.

Quantization is a function of a group's own tokens: the residual holds them in the model's
dtype, so a group completed over several decode steps quantizes to the same bytes as one
prefilled at once (a prefix hit equals a recomputation).
"""

from __future__ import annotations

from itertools import accumulate

import torch

from kvscope.kernels.kv_quant import ResidualPlan


class KiviResidual:
    def __init__(self, slices: int, num_slots: int, group: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.group = group
        self.rows = group - 1
        self.k = torch.zeros(slices, num_slots * self.rows, kv_heads, head_dim, dtype=dtype,
                             device=device)
        self.num_slots = num_slots
        self.slot_of: dict[int, int] = {}  # block -> its slot
        self.free = list(range(num_slots - 1, -1, -1))
        self._freed: list[int] = []  # blocks the pool freed, dropped at the next pass

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size()

    def on_free(self, block: int) -> None:
        """The pool freed ``block``: its slot goes back before the next pass (after that
        pass's copies, which may still read it)."""
        self._freed.append(block)

    def copy(self, pairs) -> None:
        """Copy-on-write of blocks: a partial block's residual goes with it."""
        for src, dst in pairs:
            if src in self.slot_of:
                s, d = self.slot_of[src], self._take(dst)
                self.k[:, d * self.rows:(d + 1) * self.rows] = \
                    self.k[:, s * self.rows:(s + 1) * self.rows]

    def drop_freed(self) -> None:
        for b in self._freed:
            self._give_back(b)
        self._freed.clear()

    def _take(self, block: int) -> int:
        if block in self.slot_of:  # a stale slot of a block freed and taken again
            return self.slot_of[block]
        if not self.free:
            raise RuntimeError(f"all {self.num_slots} KIVI residual slots are in use (one per "
                               "running sequence): raise max_num_seqs")
        self.slot_of[block] = slot = self.free.pop()
        return slot

    def _give_back(self, block: int) -> None:
        slot = self.slot_of.pop(block, None)
        if slot is not None:
            self.free.append(slot)

    def plan(self, seqs, block_size: int, device: torch.device) -> ResidualPlan:
        """``seqs``: (block table, start position, end position) per sequence, in packing
        order. Takes and gives back slots as groups open and complete."""
        g, rows, base = self.group, self.rows, self.k.shape[1]
        w_tok, w_row, blocks, index, sources, open_groups = [], [], [], [], [], []
        token = 0
        completed: list[int] = []
        recent = []
        for b, (table, start, end) in enumerate(seqs):
            first = start - start % g
            slot = self.slot_of.get(table[first // block_size]) if first < start else None
            recent.append((first, [slot * rows + p - first for p in range(first, start)]
                           + [base + token + p - start for p in range(start, end)]))
            for first in range(start - start % g, end, g):
                block = table[first // block_size]
                last = first + g
                old = range(first, start)  # written by earlier passes: in the residual
                if last <= end:  # completes now
                    slot = self.slot_of.get(block)
                    src = [slot * rows + p - first for p in old] if old else []
                    src += [base + token + p - start for p in range(max(first, start), last)]
                    blocks.append(block)
                    index.append(first % block_size // g)
                    sources.append(src)
                    completed.append(block)
                else:  # stays open: the new tokens join the residual
                    slot = self.slot_of[block] if old else self._take(block)
                    for p in range(max(first, start), end):
                        w_tok.append(token + p - start)
                        w_row.append(slot * rows + p - first)
                    open_groups.append((b, first, slot * rows, end - first))
            token += end - start
        for block in completed:
            if not any(o for o in open_groups if seqs[o[0]][0][o[1] // block_size] == block):
                self._give_back(block)

        def up(values, shape=(-1,)) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).view(*shape).to(device)

        firsts = list(accumulate((len(r) for _, r in recent), initial=0))[:-1]
        return ResidualPlan(up(w_tok), up(w_row), up(blocks), up(index), up(sources, (-1, g)),
                            open_groups, [(f, up(r)) for f, r in recent],
                            up([(f, row) for (f, _), row in zip(recent, firsts, strict=True)],
                               (-1, 2)))
