"""The lab's two-tier questions: host sizes as the command line writes them, the sizing line
("a 4x host tier turns 7.0 % hits into 24.0 %") and bytes moved. The replays (report.run,
report.tier_curve) are whatif.replay's: the manager's own host tier."""

from __future__ import annotations

import re

from kvscope.lab.capacity import format_bytes

UNITS = {"GiB": 2**30, "MiB": 2**20, "GB": 10**9, "MB": 10**6}
HOST_SYNTAX = "a number of blocks, or a size such as 4GiB or 512MiB"
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(" + "|".join(UNITS) + ")", re.IGNORECASE)
_UNIT = {unit.lower(): n for unit, n in UNITS.items()}


def host_size(text: str) -> tuple[int, int]:
    """A host tier's size as `kvscope run --host-blocks` and `kvscope lab --host-blocks` take
    it: '8000' -> (8000 blocks, 0), '4GiB' -> (0, 4 * 2**30 bytes); ValueError otherwise."""
    size = _SIZE.fullmatch(text.strip())
    if text.strip().isdigit() and int(text) > 0:
        return int(text), 0
    if size is None or float(size[1]) <= 0:
        raise ValueError(f"{text!r} is not a host size ({HOST_SYNTAX})")
    return 0, int(float(size[1]) * _UNIT[size[2].lower()])


def parse_host_sizes(text: str, bytes_per_block: int | None) -> list[int]:
    """`8000,32000` or `4GiB,512MiB` (sizes: with a bytes per block) -> host blocks, in order;
    ValueError naming the part."""
    sizes = []
    for part in text.split(","):
        blocks, size = host_size(part)
        if size and bytes_per_block is None:
            raise ValueError(f"{part.strip()!r}: a size needs --kv-bytes-per-token (a trace "
                             "has no model); or give host blocks")
        if size:
            blocks = size // bytes_per_block
            if blocks < 1:
                raise ValueError(f"{part.strip()!r} holds no block of {bytes_per_block:,} "
                                 "bytes")
        sizes.append(blocks)
    if len(set(sizes)) < len(sizes):
        raise ValueError(f"{text!r} names a host size twice")
    return sizes


def multiple(host_blocks: int, pool_blocks: int) -> str:
    """The host tier's size as a multiple of the device pool's: '4x', '0.5x', '2.5x'."""
    if host_blocks % pool_blocks == 0:
        return f"{host_blocks // pool_blocks}x"
    return f"{host_blocks / pool_blocks:.2g}x"


def sizing_line(row, bytes_per_block: int | None = None) -> str:
    """'a 4x host tier (16,000 blocks) turns 7.0 % hits into 24.0 % (6.1 % from the host;
    lru device pool of 4,000 blocks)', from a report.Row with a host tier; with a block's bytes,
    the tier's size in bytes and what moved: '; offloaded 1.20 GiB, loaded 300 MiB'."""
    size = f"{row.host_blocks:,} blocks"
    moved = ""
    if bytes_per_block:
        size += f", {format_bytes(row.host_blocks * bytes_per_block)}"
        moved = (f"; offloaded {format_bytes(row.offloaded_blocks * bytes_per_block)}, "
                 f"loaded {format_bytes(row.loaded_blocks * bytes_per_block)}")
    return (f"a {multiple(row.host_blocks, row.pool_blocks)} host tier ({size}, "
            f"{row.host_policy}) turns {100 * row.no_host_hit_ratio:.1f} % hits into "
            f"{100 * row.token_hit_ratio:.1f} % ({100 * row.host_hit_ratio:.1f} % from the host; "
            f"{row.policy} device pool of {row.pool_blocks:,} blocks{moved})")


def blocks_text(blocks: int, bytes_per_block: int | None = None) -> str:
    """'3 blocks (72 KiB)': blocks copied between the tiers, with their bytes where a block's
    are known; '3 blocks' otherwise (and '0 blocks')."""
    text = f"{blocks:,} block{'' if blocks == 1 else 's'}"
    return f"{text} ({format_bytes(blocks * bytes_per_block)})" if bytes_per_block and blocks \
        else text


def bytes_moved(row, bytes_per_block: int | None) -> int | None:
    """Bytes copied between the tiers (offloads plus loads); None without a bytes per block."""
    if not bytes_per_block:
        return None
    return (row.offloaded_blocks + row.loaded_blocks) * bytes_per_block
