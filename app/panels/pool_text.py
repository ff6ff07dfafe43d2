"""The block pool in words: its title with the counts (three forms, for the width) and the
hover text of a block."""

from __future__ import annotations

import numpy as np

from kvscope.app.panels.pool_groups import NO_GROUP, block_groups, group_counts, groups_line
from kvscope.app.panels.pool_host import device_copy, host_line
from kvscope.engine.snapshot import CACHED, STATE_NAMES, Snapshot
from kvscope.lab.capacity import format_bytes


def block_kv_text(settings: dict, parts: bool = True) -> str:
    """A block's KV format and bytes from a source's settings: "int4_per_token_head · 10 KiB
    (data 8 KiB + scales 2 KiB)" (the parts where the model's shape is known and `parts`);
    "": unknown."""
    fmt, per_token = settings.get("kv_format"), settings.get("kv_bytes_per_token")
    if not fmt or not per_token or not settings.get("block_size"):
        return fmt or ""
    block = per_token * settings["block_size"]
    parts = (settings.get("kv_parts") or ()) if parts else ()
    total = sum(b for _, b in parts)
    split = " (" + " + ".join(f"{part} {format_bytes(block * b / total)}" for part, b in parts) \
        + ")" if len(parts) > 1 else ""
    return f"{fmt} · {format_bytes(block)}{split}"


def describe_block(s: Snapshot, block: int, cell: str = "block", kv: str = "") -> str:
    """One line about a block in a snapshot: state, ref count, where else its hash is (a host
    tier), its format and bytes (`kv`: block_kv_text), its KV-cache group (several), owners (in
    every group's tables), tokens, hash, last use. `cell` names it ("hash slot" when attached
    to a server)."""
    tables = (s.block_tables, *s.more_tables)
    owners = sorted((rid, g) for g, group in enumerate(tables) for rid, t in group.items()
                    if block in t)
    text = (f"{cell} {block} · {STATE_NAMES[s.state[block]]} · ref {s.ref_count[block]}"
            + device_copy(s, block))  # (early: the caption is one line, cut at its width)
    if kv:
        text += f" · {kv}"
    group = block_groups(s)[block] if len(s.groups) > 1 else NO_GROUP
    if group != NO_GROUP:
        text += f" · {s.groups[group].name}"
    if owners:
        rid, g = owners[0]
        index = int(np.flatnonzero(tables[g][rid] == block)[0])
        first = index * s.block_size
        text += (" · owners " + " ".join(f"#{r}" for r in sorted({r for r, _ in owners}))
                 + f" · tokens {first}–{first + s.block_size - 1} of #{rid}")
    elif s.state[block] == CACHED:
        first = chain_depth(s, block) * s.block_size
        text += f" · tokens {first}–{first + s.block_size - 1} of its prefix"
    if s.block_hash[block]:
        text += f" · hash {int(s.block_hash[block]):016x}"[:22] + "…"
    if s.last_use[block] >= 0:
        text += f" · last use s{s.last_use[block]}"
    return text


def chain_depth(s: Snapshot, block: int) -> int:
    """Blocks before this one in its hash chain, as far as the pool still holds them (a chain
    whose parent is gone starts at the block, as the prefix tree draws it). Several groups:
    the chain within the block's group (each group caches the same prefix's blocks)."""
    hashes = s.block_hash
    if len(s.groups) > 1:
        groups = block_groups(s)
        hashes = np.where(groups == groups[block], hashes, 0)
    by_hash = {int(h): b for b, h in enumerate(hashes.tolist()) if h}
    depth, parent = 0, int(s.parent_hash[block])
    while parent in by_hash and depth < len(by_hash):
        depth, parent = depth + 1, int(s.parent_hash[by_hash[parent]])
    return depth


def pool_title(s: Snapshot, evicted: int, form: int = 0, group: int | None = None,
               counts: list | None = None) -> str:
    """The pool's title with its counts. form 0: one line; 1: the pool's size on the first
    line, the counts on the second; 2: the same, "this step" left to the tooltip. Several
    KV-cache groups: a line more, with each group's counts (`counts`: group_counts), or those
    of the `group` chosen."""
    size = f"{s.num_blocks} blocks of {s.block_size} tokens"
    totals = (f"{s.num_active_blocks} active ({s.num_shared_blocks} shared) · "
              f"{s.num_cached_blocks} cached · {s.num_free_blocks} free · {evicted} evicted")
    title = (f"<b>Block pool</b> · {size}{'<br>' if form else ' · '}{totals}"
             + ("" if form == 2 else " this step"))
    if len(s.groups) > 1:
        title += "<br>" + groups_line([g.name for g in s.groups],
                                      counts or group_counts(s), group, form)
    for tier in s.tiers()[1:]:
        title += "<br>" + host_line(tier)
    return title


TITLE_TIP = ("Blocks of the pool by state: active (held by at least one request; shared: by two "
             "or more), cached (no request holds it, its hash is kept for reuse), free (no "
             "hash), and the cached blocks evicted during the step shown. A model with several "
             "KV-cache groups: each group's blocks (those it last allocated) on the last line")
