"""One palette everywhere (pool, tree, table marks, legend, exports): Okabe-Ito based,
colour-blind safe. The pool image is a uint8 array of *display codes* mapped through LUT."""

from __future__ import annotations

import numpy as np

from kvscope.engine.snapshot import ACTIVE, CACHED, FREE, SHARED, Snapshot

FREE_COLOR = "#eeeeee"
FREE_COLOR_DARK = "#2b2b2b"
ACTIVE_COLOR = "#0072b2"
SHARED_COLOR = "#e69f00"
CACHED_COLOR = "#009e73"
EVICTED_COLOR = "#d55e00"
PREFILL_COLOR = "#56b4e9"
DECODE_COLOR = "#cc79a7"
SELECTED_OUTLINE = "#000000"
DEAD_OUTLINE = "#c000c0"  # dashed: resident blocks no lookup can reach (dead cache)
MUTED = "#666666"  # secondary text: hints, the timeline's values line until a step is hovered

# Display codes: the LUT index of each cell.
CODE_FREE = 0
CODE_ACTIVE = 1
CODE_SHARED = 2  # 2..9: ref count 2..9+, deeper orange with more owners
SHARED_SHADES = 8
CODE_CACHED = 10  # 10..41: darker = sooner to be evicted
CACHED_SHADES = 32
CODE_PAD = 43  # cells past the last block in the grid
# Blocks evicted during the step shown get an EVICTED_COLOR outline (the pool view's), never a
# fill: the cell shows what the block is now (often in use again already).


def _rgb(hex_color: str) -> np.ndarray:
    return np.array([int(hex_color[i : i + 2], 16) for i in (1, 3, 5)], dtype=np.float64)


def _mix(a: str, b: str, t: float) -> np.ndarray:
    return _rgb(a) * (1 - t) + _rgb(b) * t


def make_lut(dark: bool = False) -> np.ndarray:
    """The 256-entry RGBA lookup table for display codes."""
    lut = np.zeros((256, 4), dtype=np.uint8)
    lut[:, 3] = 255
    lut[CODE_FREE, :3] = _rgb(FREE_COLOR_DARK if dark else FREE_COLOR)
    lut[CODE_ACTIVE, :3] = _rgb(ACTIVE_COLOR)
    for i in range(SHARED_SHADES):  # ref 2 is the palette orange, deeper toward 9+
        lut[CODE_SHARED + i, :3] = _mix(SHARED_COLOR, "#7a4f00", i / SHARED_SHADES)
    for i in range(CACHED_SHADES):  # rank 0 (next victim) darkest
        lut[CODE_CACHED + i, :3] = _mix("#00402e", CACHED_COLOR, i / (CACHED_SHADES - 1))
    lut[CODE_PAD, :3] = _rgb("#ffffff" if not dark else "#1e1e1e")
    return lut


def display_codes(snap: Snapshot) -> np.ndarray:
    """uint8 display code per block, from a snapshot."""
    codes = np.full(snap.num_blocks, CODE_FREE, dtype=np.uint8)
    codes[snap.state == ACTIVE] = CODE_ACTIVE
    shared = snap.state == SHARED
    codes[shared] = CODE_SHARED + np.minimum(snap.ref_count[shared] - 2, SHARED_SHADES - 1)
    cached = snap.state == CACHED
    if cached.any():
        ranks = snap.lru_rank[cached]
        order = np.empty(len(ranks), dtype=np.int64)  # 0 = next victim among cached blocks
        order[np.argsort(ranks, kind="stable")] = np.arange(len(ranks))
        codes[cached] = CODE_CACHED + (order * CACHED_SHADES // max(1, len(ranks)))
    return codes


STATE_COLORS = {FREE: FREE_COLOR, ACTIVE: ACTIVE_COLOR, SHARED: SHARED_COLOR,
                CACHED: CACHED_COLOR}
