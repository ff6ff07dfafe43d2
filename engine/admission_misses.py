"""Why a prompt missed the prefix cache, as judged when it is admitted (the manager's
MissExplanation): caching off, too short, a full hit, a sliding-window group that cut the hit,
or the first missing block's fate (evicted, under other extra keys, forgotten, never stored)."""

from __future__ import annotations

from kvscope.engine import explain as ex
from kvscope.engine.block_hash import hash_blocks
from kvscope.engine.kv_groups import group_key


def explain_admission(mgr, request_id: int, seq, num_hit: int,
                      group_hits: tuple[int, ...]) -> ex.MissExplanation:
    """Why an admitted prompt (`seq`, a manager's _Seq) did not fully hit, judged at admission:
    `num_hit` blocks hit (both tiers), `group_hits` the blocks each group accepted on its
    first turn of the lookup."""
    n = len(seq.token_ids)
    base = dict(request_id=request_id, num_prompt_tokens=n, block_size=mgr.block_size,
                num_hit_blocks=num_hit, host_hit_blocks=seq.host_tokens // mgr.block_size)
    if not mgr.enable_prefix_caching:
        return ex.MissExplanation(reason=ex.CACHING_DISABLED, **base)
    if n <= mgr.block_size:  # no full block before the last token
        return ex.MissExplanation(reason=ex.TOO_SHORT, **base)
    if num_hit == (n - 1) // mgr.block_size:
        return ex.MissExplanation(reason=ex.FULL_HIT, **base)
    full = [g for g, group in enumerate(mgr.groups) if group.window is None]
    reach = min((group_hits[g] for g in full), default=None)
    if reach is None:  # windows only: as far as a block of the prompt is cached in each
        hashes = seq.hashes[: (n - 1) // mgr.block_size]
        reach = min(max((i + 1 for i, h in enumerate(hashes) if _cached(mgr, group_key(h, g))),
                        default=0) for g in range(len(mgr.groups)))
    if num_hit < reach:  # a sliding-window group cut what full attention (or the prompt) had
        return _window_cut(mgr, seq, reach, bool(full), group_hits, base)
    base["first_miss_block"] = num_hit
    g = full[0] if full else 0
    h = group_key(seq.hashes[num_hit], g)
    if h in mgr.pool.dropped:
        step, why, released = mgr.pool.dropped[h]
        if why == "expired":
            return ex.MissExplanation(reason=ex.EXPIRED, dropped_at_step=step, dropped_by=why,
                                      idle_s=mgr.pool.clock - released, ttl_s=mgr.pool.ttl_s,
                                      **base)
        host = mgr.host.pool.dropped.get(h) if mgr.host is not None else None
        return ex.MissExplanation(reason=ex.EVICTED, dropped_at_step=step, dropped_by=why,
                                  host_dropped_at_step=host and host[0], **base)
    prefix = seq.token_ids[: (num_hit + 1) * mgr.block_size]
    for keys, root in reversed(mgr._recent_keys.items()):
        if keys != seq.keys:
            other = group_key(hash_blocks(root, prefix, mgr.block_size)[-1], g)
            if other in mgr.pool.hash_to_block or other in mgr.pool.dropped:
                return ex.MissExplanation(reason=ex.DIFFERENT_EXTRA_KEYS,
                                          differing_keys=tuple(seq.keys.differing(keys)),
                                          **base)
    if mgr.pool.forgot_any:
        return ex.MissExplanation(reason=ex.FORGOTTEN, **base)
    return ex.MissExplanation(reason=ex.NEVER_STORED, **base)

def _window_cut(mgr, seq, reach: int, full_attention: bool, group_hits: tuple[int, ...],
                base: dict) -> ex.MissExplanation:
    """The window group that accepted least, and how many of the blocks it needs before
    the point full attention reached it found cached."""
    g = min((g for g, group in enumerate(mgr.groups) if group.window is not None),
            key=lambda g: group_hits[g])
    need = mgr.groups[g].blocks_for_hit(mgr.block_size)
    wanted = seq.hashes[max(0, reach - need):reach]
    found = sum(_cached(mgr, group_key(h, g)) for h in wanted)
    return ex.MissExplanation(reason=ex.WINDOW_CUT, first_miss_block=base["num_hit_blocks"],
                              cut_by_group=mgr.groups[g].name, reach_blocks=reach,
                              group_blocks_needed=len(wanted), group_blocks_found=found,
                              full_attention=full_attention, **base)


def _cached(mgr, key: bytes) -> bool:
    """Whether a block of either tier holds `key`."""
    return key in mgr.pool.hash_to_block or (mgr.host is not None
                                              and key in mgr.host.pool.hash_to_block)
