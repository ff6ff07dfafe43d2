"""The host tier in the pool view (a snapshot with `host`; without one nothing of this shows):
its cells as a second grid below the device's, in the same plot, after a labelled gap, drawn by
one ImageItem through the same LUT (free, held while loaded from, cached: darker = evicted
sooner); the title's line of its counts; and where a block's copies are, in words (a hash is on
the host when an evicted device block was copied there, and on the device again once loaded
back). An attached server's tiers below its GPU (CPU, STORAGE: `Snapshot.tiers`) are grids of
their own, one under another (`TierGrids`); a cell of them is numbered among all of theirs, in
order (`lower_cell`), and says which other tiers hold its (group, hash)."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtGui import QFont

from kvscope.app import palette
from kvscope.engine.snapshot import CACHED, STATE_NAMES, Snapshot
from kvscope.sessions.kv_events.slots import forms_text

LABEL_PX = 20  # the gap between the grids is at least this many pixels tall: its label's room
HOST_STATES = ("free", "held (loading back)", "held (loading back)", "cached")


def host_line(h: Snapshot) -> str:
    """The title's line of the host tier's counts (an attached server's tier: its medium, the
    hashes it holds, the forms of its stores)."""
    if h.medium:
        return (f"<b>{h.medium} tier</b> · {h.num_cached_blocks} resident of {h.num_blocks} "
                f"hash slots · {forms_text(h.forms)}")
    held = f" · {h.num_active_blocks} loading" if h.num_active_blocks else ""
    return (f"<b>Host tier</b> · {h.num_blocks} blocks: {h.num_cached_blocks} cached · "
            f"{h.num_free_blocks} free{held} · {h.num_evicted_blocks} evicted so far")


TIER_TIP = ("An attached server's tier below its GPU (vLLM's medium: CPU, STORAGE), its hash "
            "slots as a grid of its own: a cell is a block hash the tier holds. vLLM's offloading "
            "connector stores a tier's blocks as placeholders (no tokens, block_size 0: the "
            "chunk's last hash) or self-describing (hashes, parent, tokens). Hover a cell: the "
            "other tiers holding the same (group, hash)")
HOST_TIP = ("The host tier (below the device's grid): a second pool in host memory. A cached "
            "device block that is evicted is copied here under its hash; a prompt whose lookup "
            "stops on the device goes on here, and the blocks found are loaded back into device "
            "blocks. Cached: holds a hash (darker = evicted sooner from the host); loading: "
            "held while it is copied back; free: no hash")


def _hash_text(h: int) -> str:
    return f" · hash {h:016x}"[:22] + "…"


def _find(hashes: np.ndarray, h: int) -> int | None:
    where = np.flatnonzero(hashes == np.uint64(h))
    return int(where[0]) if len(where) else None


def device_copy(s: Snapshot, block: int) -> str:
    """Where a device block's hash also is: " · also on the host as block 7" ("" without one;
    an attached server's: " · also in CPU (slot 7)", " · only in GPU")."""
    h = int(s.block_hash[block])
    if s.host is None or not h:
        return ""
    if s.host.medium:
        return residency(s, s, h)
    host = _find(s.host.block_hash, h)
    return "" if host is None else f" · also on the host as block {host}"


def residency(s: Snapshot, tier: Snapshot, h: int) -> str:
    """The other tiers of an attached server holding a hash: " · also in GPU (slot 3), STORAGE
    (slot 9)", or " · only in CPU" (the short hash is one per (group, hash) in every tier)."""
    others = [f"{t.medium} (slot {b})" for t in s.tiers() if t is not tier
              and (b := _find(t.block_hash, h)) is not None]
    return " · also in " + ", ".join(others) if others else f" · only in {tier.medium}"


def lower_cell(s: Snapshot, cell: int) -> tuple[Snapshot, int] | None:
    """A cell of the grids below the device's (numbered through them in order) -> (its tier's
    snapshot, its block there); None: no such cell."""
    for tier in s.tiers()[1:]:
        if 0 <= cell < tier.num_blocks:
            return tier, cell
        cell -= tier.num_blocks
    return None


def describe_host_block(s: Snapshot, cell: int) -> str:
    """One line about a cell of a tier below the device's: state, hash, where else its hash is,
    last use."""
    h, block = lower_cell(s, cell)
    state = int(h.state[block])
    key = int(h.block_hash[block])
    if h.medium:
        return (f"{h.medium} hash slot {block} · "
                + ("resident" + residency(s, h, key) + _hash_text(key) if key else "empty")
                + (f" · stored s{h.last_use[block]}" if key and h.last_use[block] >= 0 else ""))
    text = f"host block {block} · {HOST_STATES[state] if state < len(HOST_STATES) else '?'}"
    if key:  # where else its hash is first: the caption is one line, cut at its width
        dev = _find(s.block_hash, key)
        text += (" · only on the host" if dev is None else
                 f" · also on the device as block {dev} ({STATE_NAMES[s.state[dev]]})")
        text += _hash_text(key)
    if state == CACHED:  # (free blocks come first in the policy's order)
        sooner = int(((h.state == CACHED) & (h.lru_rank < h.lru_rank[block])).sum())
        text += f" · evicted after {sooner} of the {h.num_cached_blocks} cached"
    if h.last_use[block] >= 0:
        text += f" · last use s{h.last_use[block]}"
    return text


def grid_lines(cols: int, rows: int, top: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """The segments (pairs of points) between the cells of a grid whose first row is at `top`."""
    c = np.arange(cols + 1, dtype=np.float64)
    r = np.arange(rows + 1, dtype=np.float64) + top
    x = np.concatenate([np.repeat(c, 2), np.tile([0.0, float(cols)], rows + 1)])
    y = np.concatenate([np.tile([top, top + rows], cols + 1), np.repeat(r, 2)])
    return x, y


class HostGrid:
    """The host tier's grid in the pool's plot: its image, the gap's label and the outline of
    the host block selected. `top`: the row of its first cells (the device grid's rows and the
    gap above it); `rows`: 0 without a host tier."""

    def __init__(self, plot: pg.PlotWidget):
        self.image = pg.ImageItem(axisOrder="row-major")
        self.image.setLookupTable(palette.make_lut())
        self.image.setLevels([0, 255])
        plot.addItem(self.image)
        self.label = pg.TextItem(color=palette.MUTED, anchor=(0, 0.5))
        font = QFont()
        font.setPointSizeF(8.5)
        self.label.setFont(font)
        plot.addItem(self.label)
        self.outline = pg.ScatterPlotItem(symbol="s", brush=None, pxMode=False, size=0.82,
                                          pen=pg.mkPen(palette.SELECTED_OUTLINE, width=2))
        self.outline.setZValue(2)
        plot.addItem(self.outline)
        self.snapshot: Snapshot | None = None
        self.cols, self.top, self.rows = 16, 0.0, 0
        self.offset = 0  # its first cell's number among the cells of every grid below the device
        self.selected: tuple[int, ...] = ()

    @staticmethod
    def gap_rows(cell_px: float) -> float:
        """The gap between the grids, in rows: room for the label at this cell size."""
        return max(1.0, LABEL_PX / max(cell_px, 1e-6))

    def show(self, host: Snapshot | None, cols: int, device_rows: float, gap: float,
             offset: int = 0) -> None:
        """The host pool below a grid ending at row `device_rows`, `gap` rows under it."""
        top = device_rows + gap
        self.snapshot, self.cols, self.top, self.offset = host, cols, top, offset
        if host is None:
            self.rows = 0
            self.image.clear()
            self.image.setVisible(False)
            self.label.setVisible(False)
            self.outline.setData([], [])
            return
        self.rows = -(-host.num_blocks // cols)
        grid = np.full(self.rows * cols, palette.CODE_PAD, dtype=np.uint8)
        grid[: host.num_blocks] = palette.display_codes(host)
        self.image.setImage(grid.reshape(self.rows, cols), autoLevels=False, levels=(0, 255))
        self.image.setPos(0, top)
        self.image.setVisible(True)
        self.label.setText(
            f"{host.medium} tier · {host.num_blocks:,} hash slots · {host.num_cached_blocks:,} "
            f"resident · {forms_text(host.forms)}" if host.medium else
            f"host tier · {host.num_blocks:,} blocks · {host.num_cached_blocks:,} cached")
        self.label.setPos(0, device_rows + gap / 2)
        self.label.setVisible(True)
        self.select(self.selected)

    @property
    def bottom(self) -> float:
        return self.top + self.rows

    def select(self, cells) -> None:
        """Outline these cells (numbered as `offset` says: those of this grid)."""
        n = 0 if self.snapshot is None else self.snapshot.num_blocks
        self.selected = tuple(int(c) for c in cells)
        b = np.asarray([x - self.offset for x in self.selected
                        if 0 <= x - self.offset < n], dtype=np.int64)
        self.outline.setData(x=(b % self.cols) + 0.5, y=(b // self.cols) + 0.5 + self.top)

    def cell_center(self, block: int) -> tuple[float, float]:
        return (block % self.cols) + 0.5, (block // self.cols) + 0.5 + self.top

    def block_at(self, x: float, y: float) -> int | None:
        """The host block under a point of the view (None: not a host cell)."""
        if self.snapshot is None:
            return None
        col, row = int(np.floor(x)), int(np.floor(y - self.top))
        block = row * self.cols + col
        if 0 <= col < self.cols and y >= self.top and block < self.snapshot.num_blocks:
            return block
        return None



class TierGrids:
    """The grids below the device's, one per tier (`Snapshot.tiers`), one under another."""

    def __init__(self, plot: pg.PlotWidget):
        self.plot = plot
        self.grids = [HostGrid(plot)]

    def show(self, snap: Snapshot | None, cols: int, device_rows: int, gap: float) -> None:
        tiers = [] if snap is None else snap.tiers()[1:]
        while len(self.grids) < len(tiers):
            self.grids.append(HostGrid(self.plot))
        bottom, offset = float(device_rows), 0
        for i, grid in enumerate(self.grids):
            tier = tiers[i] if i < len(tiers) else None
            grid.show(tier, cols, bottom, gap, offset)
            if tier is not None:
                bottom, offset = grid.bottom, offset + tier.num_blocks

    @property
    def shown(self) -> list[HostGrid]:
        return [g for g in self.grids if g.rows]

    @property
    def bottom(self) -> float:
        return max((g.bottom for g in self.shown), default=0.0)

    def select(self, cells) -> None:
        for grid in self.grids:
            grid.select(cells)

    def cell_at(self, x: float, y: float) -> int | None:
        """The cell under a point of the view, numbered through the grids (None: none)."""
        for grid in self.shown:
            block = grid.block_at(x, y)
            if block is not None:
                return grid.offset + block
        return None
