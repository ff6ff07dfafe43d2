"""The timeline's Transfers plot (a mixin of Timeline): for a run with a host tier
(engine.host_tier), the blocks copied to the host tier (offloaded: evicted device blocks) and
back from it (loaded: a prefix found on the host) before each step's forward pass, and the time
those copies took (StepRecord.offloaded_blocks, loaded_blocks, transfer_s; the time on the
right axis, in ms). Where the source knows a block's KV bytes (`set_block_bytes`: the engine's,
a session's from its metadata) the plot and its readout show bytes; otherwise (a session from
before they were kept, a trace) blocks. A run without a host tier has neither the plot nor its
entry in the plots menu, and draws nothing for it per frame."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg

from kvscope.app import palette
from kvscope.engine.metrics import StepRecord
from kvscope.lab.capacity import binary_unit
from kvscope.lab.tiers import blocks_text

TRANSFER_COLOR = "#444444"  # the time, on the right axis (as the batch size on the tokens plot)
LOADED_COLOR = "#6a3d9a"  # not the active blue: loaded blocks are not the blocks plot's active
TRANSFERS_TIP = ("Blocks copied to the host tier (offloaded: evicted from the device) and back "
                 "from it (loaded: a prefix found on the host) before each step's forward pass, "
                 "and the time those copies took (right axis, ms)")
TRANSFER_SERIES = ("offloaded", "loaded", "transfer")


class TransferLines:
    """The Transfers plot of a Timeline (its `_plot`, `_own_series`, `_add_step_lines`,
    `_right_axis`, `time_plot`, `series`, `shown_plots`, `_lay_out_plots`)."""

    def _init_transfers(self) -> None:
        self.transfer_plot = self._plot("transfers", "host blocks", TRANSFERS_TIP)
        self.transfer_plot.setXLink(self.time_plot)
        self.transfer_view = self._right_axis(self.transfer_plot, "copy ms")
        self.transfer_view.setZValue(-1)  # the time under the block counts
        self._transfer_top = 0.0
        self._own_series("offloaded", self.transfer_plot, palette.EVICTED_COLOR,
                         "offloaded", on="transfers")
        self._own_series("loaded", self.transfer_plot, LOADED_COLOR, "loaded",
                         on="transfers")
        self._own_series("transfer", self.transfer_view, TRANSFER_COLOR,
                         "copy ms (right axis)", on="transfers")
        self._step_lines_added = False
        self.transfers = np.zeros((0, 3))  # [step]: blocks offloaded, blocks loaded, transfer ms
        self.block_bytes: int | None = None  # a block's KV bytes (None: not known)
        self._bytes_unit = ""  # the left axis's, while it shows bytes
        self._show_transfer_series(False)

    def set_block_bytes(self, block_bytes: int | None) -> None:
        """A block's KV bytes in the run shown (None or 0: not known: blocks only)."""
        self.block_bytes = block_bytes or None
        self._bytes_unit = ""
        self.set_axis_label("transfers")
        self._redraw()

    def _clear_transfers(self) -> None:
        self.transfers = np.zeros((0, 3))
        self.offer_transfers(False)

    def _add_transfer_records(self, records: list[StepRecord]) -> None:
        """Called once the records are in `data`. Without a host tier, nothing is kept."""
        if not self.has_host_tier and not any(r.offloaded_blocks or r.loaded_blocks
                                              for r in records):
            return
        rows = np.array([(r.offloaded_blocks, r.loaded_blocks, r.transfer_s * 1e3)
                         for r in records], dtype=np.float64).reshape(len(records), 3)
        self._pad_transfers(len(self.data["step"]) - len(records))
        self.transfers = np.concatenate([self.transfers, rows])
        self.offer_transfers()  # (a run whose snapshots did not say so: its first copies)

    def _pad_transfers(self, n: int) -> None:
        """Zeros for the steps before the host tier showed itself (n steps in all)."""
        if len(self.transfers) < n:
            self.transfers = np.concatenate([self.transfers,
                                             np.zeros((n - len(self.transfers), 3))])

    def offer_transfers(self, on: bool = True) -> None:
        """The plot and its menu entry offered (the run shown has a host tier) or not."""
        if on == self.has_host_tier:
            return
        self.has_host_tier = on
        if on:
            self._pad_transfers(len(self.data["step"]))
        if on and not self._step_lines_added:
            self._step_lines_added = True
            self._add_step_lines(self.transfer_plot)
            self.set_cursor(self._cursor_step)
        self._show_transfer_series(on)
        self._lay_out_plots()

    def _show_transfer_series(self, on: bool) -> None:
        for name in TRANSFER_SERIES:
            s = self.series[name]
            s.visible = on
            for item in s.items:
                item.setVisible(on)

    def _transfer_lines(self) -> list[tuple[pg.PlotDataItem, np.ndarray]]:
        """(curve, values per step) of the Transfers plot's lines (none without a host tier);
        the right axis fitted from 0 to the longest transfer."""
        if not self.has_host_tier:
            return []
        ms = self.transfers[:, 2]
        top = max(1e-3, float(ms.max())) if len(ms) else 1e-3
        if top != self._transfer_top:
            self._transfer_top = top
            self.transfer_view.setYRange(0, top, padding=0.05)
        scale = 1.0
        if self.block_bytes:  # bytes, in the binary unit of the most moved in a step
            unit, size = binary_unit(self.block_bytes * float(self.transfers[:, :2].max(
                initial=0)))
            scale = self.block_bytes / size
            if unit != self._bytes_unit:
                self._bytes_unit = unit
                self.set_axis_label("transfers", f"host {unit}")
        return [(self.series[name].items[0], self.transfers[:, c] * (scale if c < 2 else 1))
                for c, name in enumerate(TRANSFER_SERIES)]

    def _transfers_readout(self, i: int) -> str:
        """The Transfers plot's values at sample i, while it is shown."""
        if not self.has_host_tier or "transfers" not in self.shown_plots:
            return ""
        off, load, ms = self.transfers[i]
        return (f" · offloaded {blocks_text(int(off), self.block_bytes)}, "
                f"loaded {blocks_text(int(load), self.block_bytes)}, {ms:.2g} ms")
