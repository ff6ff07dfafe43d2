"""The selected request's block table as text: logical → physical, one row per KV-cache group
(labelled with the group's name) when the model has several; a sliding window's nulls as "∅"
cells with their meaning as a tooltip. Also the blocks a finished request freed."""

from __future__ import annotations

import numpy as np
from PySide6.QtCore import QEvent, QPointF, Qt
from PySide6.QtGui import QTextCursor
from PySide6.QtWidgets import QTextEdit, QToolTip

from kvscope.app import palette
from kvscope.app.freed_tables import FreedTable
from kvscope.engine.snapshot import Snapshot

WAITING_COLOR = "#a0a0a0"
NULL_TIP = ("Released out of the sliding window: no later token attends it, so the group gave "
            "the block back while the request runs (its hash is kept: cached until evicted)")
NULL_CELL = f"<span style='color:{WAITING_COLOR}' title='{NULL_TIP}'>{{i}}→∅</span>"


class BlockTableText(QTextEdit):
    """Read-only; hovering a cell shows its tooltip (a null's meaning)."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setReadOnly(True)

    def tip_at(self, pos) -> str:
        """The tooltip of the character at `pos` (viewport coordinates), "" for none."""
        scrolled = QPointF(self.horizontalScrollBar().value(), self.verticalScrollBar().value())
        hit = self.document().documentLayout().hitTest(QPointF(pos) + scrolled, Qt.ExactHit)
        if hit < 0:
            return ""
        cursor = QTextCursor(self.document())
        cursor.setPosition(hit + 1)  # a cursor's format is the one of the character before
        return cursor.charFormat().toolTip()

    def viewportEvent(self, event) -> bool:  # noqa: N802 - Qt API
        if event.type() == QEvent.ToolTip:
            tip = self.tip_at(event.pos())
            if tip:
                QToolTip.showText(event.globalPos(), tip, self.viewport())
            else:
                QToolTip.hideText()
            return True
        return super().viewportEvent(event)


def _shared(snap: Snapshot, table: np.ndarray) -> np.ndarray:
    return (table >= 0) & (snap.ref_count[np.maximum(table, 0)] >= 2)


def table_key(snap: Snapshot, rid: int) -> tuple:
    """What table_html shows: it is made again only when this changes."""
    tables = snap.tables_of(rid)
    return (rid, *(t.tobytes() for t in tables), *(_shared(snap, t).tobytes() for t in tables))


def _row(snap: Snapshot, table: np.ndarray) -> str:
    shared = _shared(snap, table)
    return " ".join(NULL_CELL.format(i=i) if b < 0
                    else f"<b style='color:{palette.SHARED_COLOR}'>{i}→{b}</b>" if s
                    else f"{i}→{b}"
                    for i, (b, s) in enumerate(zip(table.tolist(), shared.tolist(), strict=True)))


def _rows(groups, rows: list[str]) -> str:
    if len(rows) == 1:
        return rows[0]
    return "<br>".join(f"<b>{g.name}</b>: {row}" for g, row in zip(groups, rows, strict=True))


GROUPS_TIP = ("One row per KV-cache group (the layers that share a block table): logical → "
              "physical block; shared blocks in orange; ∅: released out of the sliding window")


def table_html(snap: Snapshot, rid: int) -> tuple[str, str]:
    """The title and the table(s) of a request that holds blocks (the title's tooltip, several
    groups: GROUPS_TIP)."""
    tables = snap.tables_of(rid)
    shared = sum(int(_shared(snap, t).sum()) for t in tables)
    if len(tables) == 1:
        title = (f"Block table of #{rid}: {len(tables[0])} blocks, {shared} shared "
                 f"(logical → physical; shared in orange)")
    else:
        held = sum(int((t >= 0).sum()) for t in tables)
        nulls = sum(int((t < 0).sum()) for t in tables)
        title = f"Block tables of #{rid}: {held} blocks, {shared} shared, {nulls} released (∅)"
    return title, _rows(snap.groups, [_row(snap, t) for t in tables])


def freed_html(snap: Snapshot, freed: FreedTable) -> str:
    """The blocks a request freed, by what became of them (FreedTable.counts), one row per
    group: a window group's row starts with the nulls it had (its table is as long as the
    longest group's)."""
    b = freed.counts(snap)
    groups = range(len(snap.groups)) if len(snap.groups) > 1 else [0]
    in_group = [(freed.group == g) if len(snap.groups) > 1 else np.ones(len(freed.blocks), bool)
                for g in groups]
    longest = max(int(m.sum()) for m in in_group)
    rows = []
    for mask in in_group:
        nulls = longest - int(mask.sum()) if len(in_group) > 1 else 0
        cells = [NULL_CELL.format(i=i) for i in range(nulls)]
        for i, k in enumerate(np.flatnonzero(mask).tolist(), start=nulls):
            block = int(freed.blocks[k])
            if b["cached"][k]:
                cells.append(f"<b style='color:{palette.CACHED_COLOR}'>{i}→{block}</b>")
            elif b["in_use"][k]:
                cells.append(f"<b style='color:{palette.SHARED_COLOR}'>{i}→{block}</b>")
            elif b["gone"][k]:
                cells.append(f"<s style='color:{WAITING_COLOR}'>{i}→{block}</s>")
            else:
                cells.append(f"<span style='color:{WAITING_COLOR}'>{i}→{block}·</span>")
        rows.append(" ".join(cells))
    return _rows(snap.groups, rows)
