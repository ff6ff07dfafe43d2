"""The one selection model: the step shown (the time cursor), the selected request and blocks.

Panels subscribe to its signals, as napari's views subscribe to their model's events, and change
it directly; the window relays nothing. `step` None means "the newest step" (following a live
engine). `freed`: the blocks requests freed (the frame pump gives it the frames' events), so a
finished request's blocks that still hold its KV are outlined like a running one's."""

from __future__ import annotations

import numpy as np
from PySide6.QtCore import QObject, Signal

from kvscope.app.freed_tables import FreedTables


class Selection(QObject):
    step_changed = Signal(object)  # step or None
    request_changed = Signal(object)  # request id or None
    blocks_changed = Signal(object)  # tuple of block ids (empty: none picked by hand)
    host_blocks_changed = Signal(object)  # tuple of the host tier's block ids (empty: none)

    def __init__(self):
        super().__init__()
        self.step: int | None = None
        self.request: int | None = None
        self.blocks: tuple[int, ...] = ()
        self.host_blocks: tuple[int, ...] = ()  # a host tier's block picked (pool_host)
        self.freed = FreedTables()  # the blocks requests freed, from the frames' events

    def reset(self) -> None:
        """Nothing selected, the newest step (a new source): every subscriber is told."""
        self.step, self.request, self.blocks, self.host_blocks = None, None, (), ()
        self.freed.clear()
        self.request_changed.emit(None)
        self.blocks_changed.emit(())
        self.host_blocks_changed.emit(())
        self.step_changed.emit(None)

    def select_step(self, step: int | None) -> None:
        if step != self.step:
            self.step = step
            self.step_changed.emit(step)

    def select_request(self, rid: int | None) -> None:
        """A request: its blocks are highlighted at every step shown (a table re-selecting the
        selected request keeps the blocks picked with it)."""
        if rid != self.request:
            self.select(request=rid, blocks=())

    def select_block(self, block: int | None, snap=None) -> None:
        """One block; its lowest-numbered owner in `snap` (in any KV-cache group's tables)
        becomes the selected request."""
        owners = [] if snap is None or block is None else [
            r for group in (snap.block_tables, *snap.more_tables) for r, t in group.items()
            if block in t]
        self.select(request=min(owners) if owners else None,
                    blocks=() if block is None else (int(block),))

    def select_host_block(self, block: int | None) -> None:
        """One block of the host tier: no request, no device block selected."""
        self.select(request=None, blocks=())
        picked = () if block is None else (int(block),)
        if picked != self.host_blocks:
            self.host_blocks = picked
            self.host_blocks_changed.emit(picked)

    def select(self, step=..., request=..., blocks=...) -> None:
        """Change several at once (an event names its step, request and blocks): the request
        and blocks change first, so the step's panels draw them. A host block picked is
        dropped."""
        if (request is not ... or blocks is not ...) and self.host_blocks:
            self.host_blocks = ()
            self.host_blocks_changed.emit(())
        if request is not ... and request != self.request:
            self.request = request
            self.request_changed.emit(request)
        if blocks is not ...:  # (a window group's nulls, -1, are no blocks)
            blocks = tuple(int(b) for b in blocks if b >= 0)
        if blocks is not ... and blocks != self.blocks:
            self.blocks = blocks
            self.blocks_changed.emit(self.blocks)
        if step is not ...:
            self.select_step(step)

    def highlighted(self, snap) -> np.ndarray:
        """The blocks to outline in `snap`: those picked by hand, else the request's tables (every
        KV-cache group's; a window's nulls are no blocks), else the blocks it freed (finished)
        that still hold its KV."""
        if self.blocks:
            return np.asarray(self.blocks, dtype=np.int64)
        if snap is None:
            return np.zeros(0, dtype=np.int64)
        if self.request in snap.block_tables:
            blocks = np.concatenate(snap.tables_of(self.request)).astype(np.int64)
            return blocks[blocks >= 0]
        return self.freed.still_held(self.request, snap)
