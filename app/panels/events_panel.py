"""Events: a filterable log; clicking one selects its step, request and blocks."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QHBoxLayout,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QVBoxLayout,
    QWidget,
)

from kvscope.app.frames import Frame
from kvscope.app.selection import Selection
from kvscope.engine import events as ev

FILTERS = [(ev.EVICTED, "evicted"), (ev.COW, "cow"), (ev.PREEMPTED, "preempted"),
           (ev.CANCELLED, "cancelled"), (ev.REJECTED, "rejected"), (ev.CACHE_HIT, "hit"),
           (ev.FINISHED, "finished"), (ev.ADMITTED, "admitted")]
DEFAULT_ON = {ev.EVICTED, ev.COW, ev.PREEMPTED, ev.CANCELLED, ev.REJECTED, ev.CACHE_HIT}
MAX_ROWS = 20_000


def describe(e: ev.Event) -> str:
    who = f"#{e.request_id} " if e.request_id is not None else ""
    blocks = ""
    if e.blocks:
        shown = ", ".join(map(str, e.blocks[:8])) + (" …" if len(e.blocks) > 8 else "")
        blocks = f" {len(e.blocks)} block(s): {shown}"
    detail = f" ({e.detail})" if e.detail else ""
    return f"step {e.step:>5}  {who}{e.kind}{blocks}{detail}"


class EventsPanel(QWidget):
    event_selected = Signal(object)  # Event

    def __init__(self, selection: Selection | None = None, parent=None):
        super().__init__(parent)
        self.selection = selection or Selection()
        self.event_selected.connect(lambda e: self.selection.select(
            request=e.request_id, blocks=e.blocks, step=e.step))
        self.checks: dict[str, QCheckBox] = {}
        row = QHBoxLayout()
        for kind, label in FILTERS:
            box = QCheckBox(label)
            box.setChecked(kind in DEFAULT_ON)
            box.toggled.connect(self._refilter)
            self.checks[kind] = box
            row.addWidget(box)
        self.search = QLineEdit()
        self.search.setPlaceholderText("filter text (Ctrl+F), e.g. #3 or step 41")
        self.search.textChanged.connect(self._refilter)
        row.addWidget(self.search, 1)
        self.list = QListWidget()
        self.list.setUniformItemSizes(True)
        self.list.itemClicked.connect(lambda item: self.event_selected.emit(item.data(Qt.UserRole)))
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addLayout(row)
        layout.addWidget(self.list)
        self.events: list[ev.Event] = []

    def show_frame(self, frame: Frame) -> None:
        self.add_events(frame.events)

    def clear(self) -> None:
        self.events.clear()
        self.list.clear()

    def _visible(self, e: ev.Event) -> bool:
        box = self.checks.get(e.kind)
        if box is None or not box.isChecked():
            return False
        needle = self.search.text().strip()
        return not needle or needle in describe(e)

    def add_events(self, events: list[ev.Event]) -> None:
        self.events.extend(events)
        del self.events[:-MAX_ROWS]
        for e in events:
            if self._visible(e):
                self._add_item(e)
        while self.list.count() > MAX_ROWS:
            self.list.takeItem(0)
        if events:
            self.list.scrollToBottom()

    def _add_item(self, e: ev.Event) -> None:
        item = QListWidgetItem(describe(e))
        item.setData(Qt.UserRole, e)
        self.list.addItem(item)

    def _refilter(self, *_):
        self.list.clear()
        for e in self.events:
            if self._visible(e):
                self._add_item(e)
