"""Requests: a table of every request; the selected one's block table and why it missed."""

from __future__ import annotations

from PySide6.QtCore import QAbstractTableModel, QRect, Qt, Signal
from PySide6.QtGui import QBrush, QColor, QPalette
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QSizePolicy,
    QSplitter,
    QStyle,
    QStyledItemDelegate,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from kvscope.app import palette
from kvscope.app.frames import Frame, RequestRow, admitted
from kvscope.app.freed_tables import FreedTable
from kvscope.app.panels.block_table_view import (
    GROUPS_TIP,
    WAITING_COLOR,
    BlockTableText,
    freed_html,
    table_html,
    table_key,
)
from kvscope.app.panels.text_panel import CACHED_BG, COMPUTED_BG
from kvscope.app.selection import Selection
from kvscope.engine.snapshot import Snapshot


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.1f}"


COLUMNS = [
    ("id", "Request id (samples of n > 1 show their parent)"),
    ("state", "waiting, prefill (computing its prompt), decode, done (finished: length or "
              "stop), cancelled, rejected, failed; hover a row for the full reason"),
    ("prompt", "Prompt tokens"),
    ("cached", "Prompt tokens served from the prefix cache when first admitted, on a bar of the "
               "prompt: reused from the cache (green; hatched: loaded back from the host tier) "
               "against computed for it (blue); a thin line: waiting, not looked up yet. Hover "
               "a bar for the numbers"),
    ("output", "Output tokens generated so far"),
    ("TTFT ms", "Time to first token: from arrival to the first output token"),
    ("TPOT ms", "Time per output token after the first: (last - first) / (n - 1)"),
    ("salt", "Cache salt (tenant): blocks are never shared across different salts"),
]
BAR = 3  # "cached": the number on a reused | computed bar (no column of its own: at 1280 px
#          the table must fit its width, or a scroll bar takes a row's height)
REUSED_COLOR, COMPUTED_COLOR = CACHED_BG, COMPUTED_BG  # the text view's shades
HOST_HATCH = palette.CACHED_COLOR  # over REUSED_COLOR: the reused tokens loaded from the host


DISPLAY, ALIGNMENT, FOREGROUND, TOOLTIP = (int(r) for r in (
    Qt.DisplayRole, Qt.TextAlignmentRole, Qt.ForegroundRole, Qt.ToolTipRole))
RIGHT = int(Qt.AlignRight | Qt.AlignVCenter)


class RequestsModel(QAbstractTableModel):
    def __init__(self):
        super().__init__()
        self.rows: list[RequestRow] = []
        self._cells: dict[int, list] = {}  # row -> its display texts, made when first shown

    def set_rows(self, rows: list[RequestRow]) -> None:
        self._cells = {}
        if len(rows) == len(self.rows):
            self.rows = rows
            if rows:
                self.dataChanged.emit(self.index(0, 0),
                                      self.index(len(rows) - 1, len(COLUMNS) - 1))
        else:  # sized to contents on a reset only: per-frame sizing reads every cell
            self.beginResetModel()
            self.rows = rows
            self.endResetModel()
            self.layoutChanged.emit()

    def rowCount(self, parent=None):  # noqa: N802 - Qt API
        return len(self.rows)

    def columnCount(self, parent=None):  # noqa: N802
        return len(COLUMNS)

    def headerData(self, section, orientation, role=Qt.DisplayRole):  # noqa: N802
        if orientation == Qt.Horizontal:
            if role == Qt.DisplayRole:
                return COLUMNS[section][0]
            if role == Qt.ToolTipRole:
                return COLUMNS[section][1]
        return None

    def data(self, index, role=Qt.DisplayRole):
        # Called for every visible cell and role on every paint: the row's texts are made once
        # per set_rows, and roles that show nothing return at once.
        if role == DISPLAY:
            row = index.row()
            cells = self._cells.get(row)
            if cells is None:
                cells = self._cells[row] = _cells(self.rows[row])
            return cells[index.column()]
        if role == ALIGNMENT:
            return RIGHT if 2 <= index.column() <= 6 else None
        if (role == FOREGROUND and index.column() == 1
                and self.rows[index.row()].state.startswith("finished: rej")):
            return QColor(palette.EVICTED_COLOR)
        if role == TOOLTIP and index.column() == 1:
            return self.rows[index.row()].state
        if role == TOOLTIP and index.column() == BAR:
            return reuse_text(self.rows[index.row()])
        return None


def reuse_text(r: RequestRow) -> str:
    if not admitted(r):
        return (f"#{r.request_id}: its {r.prompt_tokens:,} prompt tokens were not looked up in "
                "the cache (waiting, rejected or cancelled first)")
    n, c = r.prompt_tokens, min(r.cached_tokens, r.prompt_tokens)
    share = f" ({c / n:.0%})" if n else ""
    text = (f"#{r.request_id}: {c:,} of {n:,} prompt tokens reused from the prefix cache"
            f"{share}, {n - c:,} computed")
    if r.host_cached_tokens:
        host = min(r.host_cached_tokens, c)
        text += (f": {c - host:,} tokens from the device, {host:,} loaded back from the host "
                 "tier")
    return text


class ReuseBar(QStyledItemDelegate):
    """The cached column: a row's reused (cached) prompt tokens against its computed ones, as
    a bar behind the number."""

    def paint(self, painter, option, index) -> None:
        # Called for each visible row on every frame: the selection's fill and the text are
        # drawn here directly (the style's item painting cost as much as the rest of the row).
        model = index.model()
        row = model.rows[index.row()]
        text = str(model.data(index))
        selected = bool(option.state & QStyle.State_Selected)
        if selected:
            painter.fillRect(option.rect, option.palette.highlight())
        r = option.rect.adjusted(2, 2, -2, -2)
        painter.save()
        painter.setPen(option.palette.color(
            QPalette.HighlightedText if selected else QPalette.Text))
        if row.prompt_tokens > 0 and r.width() > 0:
            if not admitted(row):
                painter.fillRect(QRect(r.left(), r.bottom() - 1, r.width(), 1),
                                 QColor(WAITING_COLOR))
            else:
                cached = round(r.width() * min(row.cached_tokens, row.prompt_tokens)
                               / row.prompt_tokens)
                painter.fillRect(QRect(r.left(), r.top(), cached, r.height()),
                                 QColor(REUSED_COLOR))
                if row.host_cached_tokens:  # the tail of the hit: hatched
                    host = min(cached, round(r.width() * row.host_cached_tokens
                                             / row.prompt_tokens))
                    painter.fillRect(QRect(r.left() + cached - host, r.top(), host, r.height()),
                                     QBrush(QColor(HOST_HATCH), Qt.BDiagPattern))
                painter.fillRect(QRect(r.left() + cached, r.top(), r.width() - cached,
                                       r.height()), QColor(COMPUTED_COLOR))
                painter.setPen(QColor("#000000"))  # dark on the light bar, selected or not
        painter.drawText(option.rect.adjusted(2, 0, -4, 0), RIGHT, text)
        painter.restore()


def short_state(state: str) -> str:
    """"finished: length" -> "done", "finished: cancelled" -> "cancelled": the full reason is
    the cell's tooltip."""
    if not state.startswith("finished: "):
        return state
    reason = state.removeprefix("finished: ")
    return "done" if reason in ("length", "stop") else reason


def _cells(r: RequestRow) -> list:
    rid = f"#{r.request_id}" + (f" (of #{r.parent_id})" if r.parent_id is not None else "")
    return [rid, short_state(r.state), r.prompt_tokens, r.cached_tokens, r.output_tokens,
            _ms(r.ttft_s), _ms(r.tpot_s), r.cache_salt or ""]


class RequestsPanel(QWidget):
    request_selected = Signal(object)
    cancel_requested = Signal(int)
    explain_requested = Signal(int)

    def __init__(self, selection: Selection | None = None, parent=None):
        super().__init__(parent)
        self.selection = selection or Selection()
        self.selection.request_changed.connect(self._on_selected_elsewhere)
        self.snapshot: Snapshot | None = None
        self.model = RequestsModel()
        self.table = QTableView()
        self.table.setModel(self.model)
        self.bar_delegate = ReuseBar(self.table)
        self.table.setItemDelegateForColumn(BAR, self.bar_delegate)
        self.table.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SingleSelection)
        self.table.verticalHeader().hide()
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.Interactive)
        self.table.setWordWrap(False)
        self.table.verticalHeader().setDefaultSectionSize(self.fontMetrics().height() + 6)
        self.table.resizeColumnsToContents()  # the headers' widths: no scroll bar while empty
        self.table.selectionModel().selectionChanged.connect(self._on_selection)
        self.cancel_button = QPushButton("Cancel request")
        self.explain_button = QPushButton("Why did this miss?")
        self.cancel_button.clicked.connect(lambda: self._emit_for_selected(self.cancel_requested))
        self.explain_button.clicked.connect(
            lambda: self._emit_for_selected(self.explain_requested))
        self.block_table = BlockTableText()
        self.block_table.setPlaceholderText("Select a request to see its block table")
        buttons = QHBoxLayout()
        buttons.addWidget(self.cancel_button)
        buttons.addWidget(self.explain_button)
        buttons.addStretch(1)
        top = QWidget()
        top_layout = QVBoxLayout(top)
        top_layout.setContentsMargins(0, 0, 0, 0)
        top_layout.addWidget(self.table)
        top_layout.addLayout(buttons)
        bottom = QWidget()
        bottom_layout = QVBoxLayout(bottom)
        bottom_layout.setContentsMargins(0, 0, 0, 0)
        self.block_table_title = QLabel("Block table")
        self.block_table_title.setWordWrap(True)  # a long title wraps, never widens the window
        self.block_table_title.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        bottom_layout.addWidget(self.block_table_title)
        bottom_layout.addWidget(self.block_table)
        split = QSplitter(Qt.Vertical)
        split.addWidget(top)
        split.addWidget(bottom)
        self.block_table.setMinimumHeight(self.fontMetrics().height() * 2)
        split.setStretchFactor(0, 3)  # the table gets the room; the block table scrolls
        split.setStretchFactor(1, 1)
        split.setSizes([300, 100])
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addWidget(split)
        self.selected: int | None = None
        self._table_shown: tuple | None = None  # what the block table shows

    def show_frame(self, frame: Frame) -> None:
        if frame.requests is not None:
            self.set_rows(frame.requests)
        if frame.snapshot is not None:
            self.snapshot = frame.snapshot
            self.show_block_table(self.snapshot, self.selection.request)

    def clear(self) -> None:
        self.snapshot = None
        self.set_rows([])
        self.show_block_table(None, self.selection.request)

    def set_read_only(self, why: str | None) -> None:
        """Cancelling is off (with `why` as the tooltip) while the source cannot change."""
        self.cancel_button.setEnabled(why is None)
        self.cancel_button.setToolTip(why or "Cancel the selected request")

    def _on_selected_elsewhere(self, rid) -> None:
        self.select(rid)
        self.show_block_table(self.snapshot, rid)

    def set_rows(self, rows: list[RequestRow]) -> None:
        grew = len(rows) != len(self.model.rows)
        bar = self.table.verticalScrollBar()
        at_end = bar.value() >= bar.maximum()  # the user has not scrolled up to read
        self.model.set_rows(rows)
        if grew and at_end:
            self.table.scrollToBottom()  # new requests come into view
        if grew and len(rows) <= 64:  # sizing reads every cell: only while the table is small
            self.table.resizeColumnsToContents()
        if self.selected is not None:
            self._reselect()

    def _reselect(self) -> None:
        for i, r in enumerate(self.model.rows):
            if r.request_id == self.selected:
                if self.table.currentIndex().row() != i:
                    self.table.blockSignals(True)
                    self.table.selectRow(i)
                    self.table.blockSignals(False)
                return

    def select(self, rid: int | None) -> None:
        self.selected = rid
        if rid is None:
            self.table.clearSelection()
        else:
            self._reselect()

    def _on_selection(self, *_):
        rows = self.table.selectionModel().selectedRows()
        rid = self.model.rows[rows[0].row()].request_id if rows else None
        self.selected = rid
        self.request_selected.emit(rid)
        self.selection.select_request(rid)

    def _emit_for_selected(self, signal) -> None:
        if self.selected is not None:
            signal.emit(self.selected)

    def show_block_table(self, snap: Snapshot | None, rid: int | None) -> None:
        """Called on every frame: the text is set again only when it changes."""
        if snap is None or rid is None or rid not in snap.block_tables:
            row = self._row(rid)
            freed = None if snap is None else self.selection.freed.get(rid, snap)
            if row is not None and freed is not None:
                self._show_freed_blocks(snap, row, freed)
                return
            if self._table_shown != (rid,):
                self._table_shown = (rid,)
                note = "" if rid is None else f"#{rid} holds no blocks (waiting or finished)"
                if row is not None and row.state.startswith("finished"):
                    note = f"#{rid} finished holding no blocks"
                self.block_table_title.setText("Block table")
                self.block_table.setPlainText(note)
            return
        shown = table_key(snap, rid)
        if shown == self._table_shown:
            return
        self._table_shown = shown
        title, html = table_html(snap, rid)
        self.block_table_title.setText(title)
        self.block_table_title.setToolTip(GROUPS_TIP if len(snap.groups) > 1 else "")
        self.block_table.setHtml(html)

    def _row(self, rid: int | None) -> RequestRow | None:
        for r in reversed(self.model.rows):
            if r.request_id == rid:
                return r
        return None

    def _show_freed_blocks(self, snap: Snapshot, row: RequestRow, freed: FreedTable) -> None:
        """The blocks a finished (or preempted) request freed: which still hold its KV (same
        hash: cached, or in use by other requests; outlined in the pool) and which lost it
        (evicted or reset). Its last, partial block never had a hash: it was freed."""
        rid, table = row.request_id, freed.blocks
        b = freed.counts(snap)
        shown = ("freed", rid, row.state, table.tobytes(), b["cached"].tobytes(),
                 b["in_use"].tobytes(), freed.group.tobytes(), len(snap.groups))
        if shown == self._table_shown:
            return
        self._table_shown = shown
        n_keep, partial = int(b["kept"].sum()), int(b["partial"].sum())
        did = "finished" if row.state.startswith("finished") else "freed its blocks (preempted)"
        self.block_table_title.setText(
            f"#{rid} {did}: {n_keep} of {len(table)} blocks still in the pool "
            f"({int(b['cached'].sum())} cached, {int(b['in_use'].sum())} in use by others), "
            f"{int(b['gone'].sum())} evicted" + (f", {partial} partial" if partial else ""))
        self.block_table_title.setToolTip(
            "The blocks this request freed, looked up again by hash (outlined in the pool): "
            "green, still cached (a later prompt with the same prefix reuses it); orange, in use "
            "by other requests; struck out, evicted (its hash dropped, the block reused or "
            "freed); grey with a dot, its last, partial block (never cached)")
        self.block_table.setHtml(freed_html(snap, freed))
