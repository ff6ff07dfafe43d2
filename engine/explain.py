"""Why a request missed the prefix cache: the answer `explain_miss` gives. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

# Reasons, from "nothing to explain" to the specific causes of a miss.
FULL_HIT = "full_hit"  # every block that may be reused was reused
CACHING_DISABLED = "caching_disabled"
TOO_SHORT = "too_short"  # no full block before the last prompt token: nothing reusable
NEVER_STORED = "never_stored"  # no request stored these tokens after this prefix
EVICTED = "evicted"  # stored once, evicted (or dropped by a reset) at a known step
DIFFERENT_EXTRA_KEYS = "different_extra_keys"  # same tokens stored under another salt/adapter/model
FORGOTTEN = "forgotten"  # not cached, and older than the eviction history kept
EXPIRED = "expired"  # stored once, its TTL ran out before this request came (a timed policy)
WINDOW_CUT = "window_cut"  # a sliding-window group lacked blocks before the point others reached


@dataclass(frozen=True)
class MissExplanation:
    request_id: int
    reason: str
    num_prompt_tokens: int
    block_size: int
    num_hit_blocks: int
    first_miss_block: int | None = None  # logical block index of the first miss
    dropped_at_step: int | None = None  # for EVICTED
    dropped_by: str | None = None  # "evicted" or "reset"
    differing_keys: tuple[str, ...] = ()  # for DIFFERENT_EXTRA_KEYS: "cache_salt", "adapter", ...
    # WINDOW_CUT: the group that cut the hit ("sliding window 4096"), the blocks full attention
    # (or the prompt, without full attention) reached, the blocks before that point the group
    # needs cached and how many of them it had
    cut_by_group: str | None = None
    reach_blocks: int = 0
    group_blocks_needed: int = 0
    group_blocks_found: int = 0
    full_attention: bool = False  # the model has full-attention layers (they reached the point)
    # The host tier: blocks of the hit loaded back from it; for EVICTED, the step its host copy
    # was evicted too (None: it never had one, or no host tier)
    host_hit_blocks: int = 0
    host_dropped_at_step: int | None = None
    # EXPIRED: seconds from the block's last use to this request, and the TTL
    idle_s: float | None = None
    ttl_s: float | None = None

    @property
    def num_hit_tokens(self) -> int:
        return self.num_hit_blocks * self.block_size

    @property
    def message(self) -> str:
        bs, n = self.block_size, self.num_prompt_tokens
        hit = f"{self.num_hit_blocks} block(s) ({self.num_hit_tokens} tokens) reused"
        if self.host_hit_blocks:
            hit += (f" ({self.host_hit_blocks} of them evicted from the device earlier and loaded "
                    "back from the host tier)")
        if self.reason == FULL_HIT:
            tail = n % bs
            if tail:
                return (f"No miss: {hit}; the last {tail} token(s) are a partial block (fewer "
                        f"than {bs}), and a partial block is never cached (only full blocks "
                        "are): they are computed.")
            return (f"No miss: {hit}; the last block is computed again: its last token is the "
                    "prompt's last, which must be computed to produce logits, and a block is "
                    "reused whole or not at all.")
        if self.reason == CACHING_DISABLED:
            return "Prefix caching is disabled: every prompt token is computed."
        if self.reason == TOO_SHORT:
            return (f"The prompt has {n} tokens: no full block of {bs} comes before its last "
                    "token, and only full blocks are shared (the last token is always computed).")
        if self.reason == WINDOW_CUT:
            reach = self.reach_blocks * bs
            before = (f"full attention cached {reach:,} tokens" if self.full_attention
                      else f"the cache holds blocks of this prompt up to token {reach:,}")
            return (f"{hit}: {before}; the {self.cut_by_group} group had "
                    f"{self.group_blocks_found} of the {self.group_blocks_needed} blocks it "
                    f"needs right before token {reach:,}, so the hit is "
                    f"{self.num_hit_tokens:,} tokens (every group must accept a hit).")
        i = self.first_miss_block
        where = f"block {i} (tokens {i * bs}-{(i + 1) * bs - 1})"
        if self.reason == EVICTED:
            how = "dropped by a cache reset" if self.dropped_by == "reset" else "evicted"
            host = ("" if self.host_dropped_at_step is None else
                    f", and its copy on the host tier evicted at step {self.host_dropped_at_step}")
            return f"{hit}; first miss at {where}: it was cached, then {how} at step " \
                   f"{self.dropped_at_step}{host}."
        if self.reason == EXPIRED:
            return (f"{hit}; first miss at {where}: it was cached, then expired "
                    f"{self.idle_s:,.0f} s after its last use (TTL {self.ttl_s:,.0f} s).")
        if self.reason == DIFFERENT_EXTRA_KEYS:
            keys = ", ".join(self.differing_keys)
            return (f"{hit}; first miss at {where}: the same tokens are cached under a different "
                    f"{keys}, and blocks are never shared across those.")
        if self.reason == FORGOTTEN:
            return (f"{hit}; first miss at {where}: not cached, and not in the eviction history "
                    "kept (it may have been evicted long ago).")
        return (f"{hit}; first miss at {where}: no earlier request stored these tokens after this "
                "prefix.")
