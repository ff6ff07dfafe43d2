"""What the window adds while it shows an attached fleet: a table above the pool, one row per
instance (its health light, name, resident blocks, prefix-cache hit rate and KV usage from its
metrics, restarts, and whether it holds the clicked block), "all instances" on top. Selecting a
row (click, or ↑ ↓) shows that instance's slots in the pool and tree; a click on a cell says in
Details which instances hold that block hash (per tier) and how much of its chain each holds, and
marks their rows."""

from __future__ import annotations

import html

from PySide6.QtCore import Qt
from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import QAbstractItemView, QHeaderView, QTableWidget, QTableWidgetItem

from kvscope.app.window.attach_view import HEALTHY, UNHEALTHY, WAITING

COLUMNS = ("", "Instance", "Resident", "Hit %", "KV %", "Restarts", "Holds block")
TIPS = ("Health: green when nothing was missed, amber while nothing arrived, red when something "
        "was (restarts, gaps not repaired, orphans, disconnects: hover the row)",
        "The instance's name (--endpoint NAME=... or the fleet file)",
        "Block hashes its mirror holds now (every KV group and tier)",
        "Prefix-cache token hit rate since attaching: hit tokens / query tokens from its metrics "
        "(vllm:prefix_cache_hits / _queries; SGLang's cache_hit_rate gauge)",
        "KV-cache usage from its metrics (vllm:kv_cache_usage_perc, sglang:token_usage)",
        "Times its publisher restarted (its sequence went back, or its replay showed a new "
        "lifetime): its blocks were dropped and rebuilt",
        "For the block clicked in the pool: the tiers in which this instance holds the same "
        "hash, and the leading blocks of its chain it holds (a cache-aware router's score)")
ALL = "all instances"
LIGHTS = {True: ("●", HEALTHY), None: ("○", WAITING), False: ("▲", UNHEALTHY)}
TABLE_ROWS_SHOWN = 4  # the table's height, in rows, before it scrolls (the pool keeps its room)


def percent(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


class FleetOverlay:
    """The fleet table and its links to the pool, tree and Details; inactive otherwise."""

    def __init__(self, window):
        self.w = window
        self.source = None
        self.holds: dict[str, str] = {}  # instance -> what it holds of the clicked block
        self.slot: int | None = None  # the slot clicked (a recording: its holders at each step)
        self.table = QTableWidget(0, len(COLUMNS))
        t = self.table
        t.setHorizontalHeaderLabels(COLUMNS)
        for i, tip in enumerate(TIPS):
            t.horizontalHeaderItem(i).setToolTip(tip)
        t.verticalHeader().hide()
        t.verticalHeader().setDefaultSectionSize(t.fontMetrics().height() + 6)  # compact rows
        t.setSelectionBehavior(QAbstractItemView.SelectRows)
        t.setSelectionMode(QAbstractItemView.SingleSelection)
        t.setEditTriggers(QAbstractItemView.NoEditTriggers)
        header = t.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeToContents)
        header.setSectionResizeMode(len(COLUMNS) - 1, QHeaderView.Stretch)
        t.setToolTip("The fleet: one row per attached instance. Select a row to see its pool "
                     "and tree; click a block to see which instances hold it")
        t.itemSelectionChanged.connect(self._pick)
        t.hide()
        window.selection.blocks_changed.connect(self._who_holds)

    @property
    def active(self) -> bool:
        return self.source is not None

    def set_source(self, source) -> None:
        self.source = source if hasattr(source, "holders") else None
        self.holds, self.slot = {}, None
        t = self.table
        t.blockSignals(True)
        t.setRowCount(0)
        if self.active:
            t.setRowCount(1 + len(source.names))
            for row, name in enumerate([ALL, *source.names]):
                for col in range(len(COLUMNS)):
                    t.setItem(row, col, QTableWidgetItem(""))
                t.item(row, 1).setText(name)
            t.selectRow(0)
            t.setFixedHeight(t.horizontalHeader().sizeHint().height() + 4 +
                             t.verticalHeader().defaultSectionSize() *
                             min(TABLE_ROWS_SHOWN, t.rowCount()))
        t.blockSignals(False)
        t.setVisible(self.active)
        if self.active:  # the pool's rows get the note's room (its words: the pool title's tip)
            self.w.attach_view.note.hide()
            self.w.centralWidget().layout().activate()  # else its room stays until a resize

    def after_frame(self, frame) -> None:
        if self.active:
            if not self.source.live and self.slot is not None:  # a recording at another step
                self._holders(self.slot)
            self.refresh()

    def refresh(self) -> None:
        """The rows as the fleet session's newest tick has them (a recorded fleet: as recorded
        at the step shown)."""
        rows = self.source.rows()
        t = self.table
        total = sum(r.resident for r in rows)
        self._fill(0, None, str(total), "", "", str(sum(r.restarts for r in rows)), "")
        for i, r in enumerate(rows, 1):
            self._fill(i, r.ok, str(r.resident), percent(r.hit_rate), percent(r.kv_usage),
                       str(r.restarts), self.holds.get(r.name, "not held" if self.holds else ""))
            tip = f"{r.name} ({r.endpoint})\n" + "\n".join(r.health) + \
                (f"\nhashes differently: {r.parity}" if r.parity else "")
            for col in range(len(COLUMNS) - 1):
                t.item(i, col).setToolTip(tip)

    def _fill(self, row: int, ok, resident, hit, usage, restarts, holds) -> None:
        t = self.table
        light, color = LIGHTS[ok] if row else ("", "#000000")
        cells = (light, None, resident, hit, usage, restarts, holds)
        for col, text in enumerate(cells):
            if text is not None:
                t.item(row, col).setText(text)
        t.item(row, 0).setForeground(QBrush(QColor(color)))
        for col in (2, 3, 4, 5):
            t.item(row, col).setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
        held = bool(holds) and holds != "not held"
        t.item(row, 6).setForeground(QBrush(QColor(HEALTHY if held else "#555555")))

    def _pick(self) -> None:
        """A row selected: that instance's slots (row 0: all) in the pool and tree."""
        rows = self.table.selectionModel().selectedRows()
        if not self.active or not rows:
            return
        row = rows[0].row()
        self.source.instance = None if row == 0 else row - 1
        w = self.w
        step = w.selection.step
        w.selection.reset()
        if self.source.live:
            w.frame_pump.show(self.source.newest())
        else:  # a recorded fleet: the same step, that instance's slots
            w.selection.select_step(step)

    def _who_holds(self, blocks) -> None:
        """A cell clicked: which instances hold its block hash, in Details and in the table."""
        if not self.active or len(blocks) != 1:
            return
        slot = int(next(iter(blocks)))
        found = self._holders(slot)
        if found is None:
            return
        holders, chain = found
        self.refresh()
        lines = [f"{name}: {self.holds.get(name, 'not held')}" for name in self.source.names]
        self.w.details.show_text(
            "Hash slot", html.escape(self.source.describe_slot(slot)) +
            f"<br><b>Held by {len(holders)} of {len(lines)} instances</b> (tiers; prefix: the "
            f"leading blocks of its {len(chain)}-block chain each holds in its tier)<br>" +
            "<br>".join(html.escape(x) for x in lines))

    def _holders(self, slot: int) -> tuple[dict, list] | None:
        """`holds` for the block in a slot, at the step shown (an empty slot: none); returns
        (instance -> tiers holding it, its chain), None for an empty slot."""
        self.slot = slot
        found = self.source.holders(slot)
        if found is None:
            self.holds = {}
            return None
        _, holders, chain, prefix = found
        self.holds = {name: " + ".join(sorted(tiers, key=lambda m: (m != "GPU", m)))
                      + f" · prefix {prefix[name]}/{len(chain)}"
                      for name, tiers in holders.items()}
        self.holds.update({name: f"not held · prefix {n}/{len(chain)}"
                           for name, n in prefix.items() if name not in holders and n})
        return holders, chain
