"""KV-cache groups (vLLM's `KVCacheGroupSpec`): the layers that share one block table. Torch-free.

A model's layers are grouped by attention kind: full attention, or a sliding window of W tokens
(one group per distinct W). Each request has one block table per group; every group draws its
blocks from the one physical pool, and a layer of group g reads and writes its KV through group
g's table (as vLLM's uniform page size: a block id is the same page size in every group).

Freeing and hits follow vLLM 0.33 (`SlidingWindowManager`, `HybridKVCacheCoordinator`):
- a sliding-window group releases, during the request, the blocks that fall wholly before the
  window of the next token to compute (`skipped_tokens`); the table keeps a null (`NULL`) in
  their place; a released block keeps its hash and stays cached until it is reused;
- a hit of h tokens needs, in a sliding-window group, only the `blocks_for_hit` blocks before h
  cached (scanning from the right); the request's hit is the longest length every group
  accepts (each group may only shrink it, until none does);
- block hashes are stored per group (`group_key`): an equal hash in two groups never matches
  across them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NULL = -1  # a block table entry for a block released out of a sliding window
FULL, SLIDING = "full_attention", "sliding_window"  # the kinds, as vLLM's spec kinds say them


@dataclass(frozen=True)
class KVGroup:
    window: int | None = None  # a sliding window of W tokens; None: full attention
    layers: tuple[int, ...] = ()  # the model's layers in this group (empty: every layer)
    # A server's spec kind that the engine does not model (an attached vLLM's mla_attention,
    # mamba, ...; "unknown": none published), named, never simulated: `kind` stays how the
    # engine would treat the group (full attention, or a window when one was published)
    spec_kind: str | None = None

    @property
    def kind(self) -> str:
        return FULL if self.window is None else SLIDING

    @property
    def name(self) -> str:
        """For people: "full attention", "sliding window 4096", "mla attention"."""
        if self.spec_kind:
            words = "kind unknown" if self.spec_kind == "unknown" else self.spec_kind
            return words.replace("_", " ") + \
                (f" {self.window}" if self.window is not None else "")
        return "full attention" if self.window is None else f"sliding window {self.window}"

    @classmethod
    def of_spec(cls, kind: str | None, window: int | None) -> KVGroup:
        """The group a vLLM server describes with `kv_cache_spec_kind` and
        `kv_cache_spec_sliding_window` (None: not published)."""
        if kind == FULL and window is None:
            return cls()
        if kind == SLIDING and window is not None:
            return cls(window)
        return cls(window, spec_kind=kind or "unknown")

    def skipped_tokens(self, num_computed: int) -> int:
        """Tokens no later query of a request with `num_computed` tokens in its KV attends (the
        next query, at position num_computed, sees keys > num_computed - W)."""
        return 0 if self.window is None else max(0, num_computed - self.window + 1)

    def blocks_for_hit(self, block_size: int) -> int:
        """Cached blocks right before a hit point that this group needs (vLLM: cdiv(W - 1,
        block_size))."""
        return 0 if self.window is None else -(-(self.window - 1) // block_size)


ONE_GROUP = (KVGroup(),)


def groups_of(layer_windows: Sequence[int | None]) -> tuple[KVGroup, ...]:
    """The groups of a model whose layer i attends within `layer_windows[i]` (None: full):
    full attention first, then each window, smallest first."""
    windows = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
    return tuple(KVGroup(w, tuple(i for i, x in enumerate(layer_windows) if x == w))
                 for w in windows) or ONE_GROUP


def group_key(block_hash: bytes, group: int) -> bytes:
    """The key a block hash is stored under in `group`: the hash itself in group 0 (so a model
    with one group keys its pool as before), the hash and the group's number after it
    otherwise (a longer key never equals a group-0 one). Works for full and short hashes."""
    return block_hash if group == 0 else block_hash + bytes((group,))


def describe(groups: Sequence[KVGroup]) -> str:
    """One line for people: "2 KV groups: full attention (layers 0, 2), sliding window 4 ..."."""
    if len(groups) == 1:
        return groups[0].name
    parts = [g.name + (f" ({len(g.layers)} layers)" if g.layers else "") for g in groups]
    return f"{len(groups)} KV groups: " + ", ".join(parts)
