"""Global selection: a request, a block or a step selected in one panel is highlighted in all."""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal


class Selection(QObject):
    request_changed = Signal(object)  # request id or None
    block_changed = Signal(object)  # block id or None
    step_changed = Signal(object)  # step or None

    def __init__(self):
        super().__init__()
        self.request: int | None = None
        self.block: int | None = None
        self.step: int | None = None

    def select_request(self, rid: int | None) -> None:
        if rid != self.request:
            self.request = rid
            self.request_changed.emit(rid)

    def select_block(self, block: int | None) -> None:
        if block != self.block:
            self.block = block
            self.block_changed.emit(block)

    def select_step(self, step: int | None) -> None:
        if step != self.step:
            self.step = step
            self.step_changed.emit(step)
