"""File → Attach…: one server, or a fleet of named servers (a small table, filled by hand or from a
fleet file: `name endpoint [replay] [metrics]` lines, as `kvscope attach --fleet`). What cannot
be used is said in one line under the table, and the dialog stays open."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from kvscope.app.window.attach_view import UNHEALTHY
from kvscope.sessions.kv_events.fleet import check_fleet, parse_instance, read_fleet
from kvscope.sessions.kv_events.slots import DEFAULT_SLOTS

FLEET_COLUMNS = ("Name", "KV events endpoint", "Replay (optional)", "Metrics (optional)")
FLEET_TIPS = ("1-32 letters, digits, '_', '.', ':' or '-': the instance's row in the window",
              "Its KV-event PUB endpoint (tcp://HOST:PORT, ipc://PATH)",
              "Its replay endpoint (tcp://HOST:PORT): history and gap repair",
              "Its metrics URL (http://HOST:8000/metrics): hit rate and KV usage")


class AttachDialog(QDialog):
    """Where to attach. Non-modal: `attach_requested(options)` when Attach is pressed and what
    was typed can be used (MainWindow.attach's arguments; `fleet` for the fleet tab)."""

    attach_requested = Signal(dict)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setWindowTitle("Attach to servers' KV events")
        self.tabs = QTabWidget()
        self.tabs.addTab(self._one_server(), "One server")
        self.tabs.addTab(self._fleet(), "Fleet")
        self.topic = QLineEdit()
        self.topic.setPlaceholderText("(all topics)")
        self.record = QLineEdit()
        self.record.setPlaceholderText("(optional) a .kvscope file to record to")
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        record_row = QHBoxLayout()
        record_row.addWidget(self.record, 1)
        record_row.addWidget(browse)
        self.slots = QSpinBox(minimum=16, maximum=1 << 20, value=DEFAULT_SLOTS)
        self.slots.setToolTip("Cells in the pool view: one per block hash the servers hold "
                              "(physical block ids are not published)")
        shared = QFormLayout()
        shared.addRow("Topic", self.topic)
        shared.addRow("Record to", record_row)
        shared.addRow("Hash slots", self.slots)
        self.error = QLabel()
        self.error.setStyleSheet(f"color: {UNHEALTHY}")
        self.error.hide()
        self.buttons = QDialogButtonBox(QDialogButtonBox.Ok | QDialogButtonBox.Cancel)
        self.buttons.button(QDialogButtonBox.Ok).setText("Attach")
        self.buttons.accepted.connect(self._accept)
        self.buttons.rejected.connect(self.reject)
        box = QVBoxLayout(self)
        box.addWidget(self.tabs)
        box.addLayout(shared)
        box.addWidget(self.error)
        box.addWidget(self.buttons)
        self.setMinimumWidth(560)

    def _one_server(self) -> QWidget:
        page = QWidget()
        self.endpoint = QLineEdit("tcp://127.0.0.1:5557")
        self.endpoint.setToolTip("The server's KV-event PUB endpoint (vLLM --kv-events-config "
                                 "'{\"publisher\": \"zmq\", \"endpoint\": ...}', or kvscope serve "
                                 "--kv-events)")
        self.replay = QLineEdit()
        self.replay.setPlaceholderText("tcp://HOST:5558 (optional: history and gap repair)")
        self.metrics = QLineEdit()
        self.metrics.setPlaceholderText("http://HOST:8000/metrics (optional)")
        form = QFormLayout(page)
        form.addRow("KV events endpoint", self.endpoint)
        form.addRow("Replay endpoint", self.replay)
        form.addRow("Metrics URL", self.metrics)
        return page

    def _fleet(self) -> QWidget:
        page = QWidget()
        t = self.fleet = QTableWidget(0, len(FLEET_COLUMNS))
        t.setHorizontalHeaderLabels(FLEET_COLUMNS)
        for i, tip in enumerate(FLEET_TIPS):
            t.horizontalHeaderItem(i).setToolTip(tip)
        t.verticalHeader().hide()
        t.setSelectionBehavior(QAbstractItemView.SelectRows)
        t.horizontalHeader().setSectionResizeMode(QHeaderView.Stretch)
        t.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeToContents)
        t.setToolTip("One row per server: each is attached on its own (its own health; one "
                     "that drops never stalls the others) and shown as a row above the pool")
        self.add_button = QPushButton("Add")
        self.add_button.clicked.connect(lambda: self.add_instance())
        self.remove_button = QPushButton("Remove")
        self.remove_button.clicked.connect(self._remove)
        self.load_button = QPushButton("Load fleet file…")
        self.load_button.setToolTip("A file of `name endpoint [replay] [metrics]` lines (as "
                                    "kvscope attach --fleet FILE); # starts a comment")
        self.load_button.clicked.connect(self._choose_fleet)
        row = QHBoxLayout()
        for b in (self.add_button, self.remove_button, self.load_button):
            row.addWidget(b)
        row.addStretch(1)
        box = QVBoxLayout(page)
        box.addWidget(t)
        box.addLayout(row)
        return page

    # ----------------------------------------------------------------- the fleet
    def add_instance(self, *fields: str) -> None:
        """A row: name, endpoint, replay, metrics (missing ones empty)."""
        t = self.fleet
        row = t.rowCount()
        t.insertRow(row)
        for col in range(len(FLEET_COLUMNS)):
            t.setItem(row, col, QTableWidgetItem(fields[col] if col < len(fields) else ""))
        if not fields:
            t.item(row, 0).setText(f"i{row}")
            t.setCurrentCell(row, 1)
            t.editItem(t.item(row, 1))

    def _remove(self) -> None:
        for row in sorted({i.row() for i in self.fleet.selectedIndexes()}, reverse=True):
            self.fleet.removeRow(row)

    def _choose_fleet(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "A fleet file", "",
                                              "Fleet files (*.txt *.fleet);;All files (*)")
        if path:
            self.load_fleet(path)

    def load_fleet(self, path: str) -> bool:
        """The fleet file's instances in the table (replacing its rows); False and the error line
        if it cannot be read."""
        try:
            instances = read_fleet(path)
        except ValueError as e:
            self._say(str(e).removeprefix("--fleet "))
            return False
        self.fleet.setRowCount(0)
        for i in instances:
            self.add_instance(i.name, i.endpoint, i.replay or "", i.metrics or "")
        self.tabs.setCurrentIndex(1)
        self._say("")
        return True

    def instances(self) -> list:
        """The fleet table's rows as instances (empty rows skipped); ValueError naming the row."""
        t, out = self.fleet, []
        for row in range(t.rowCount()):
            cells = [t.item(row, c).text().strip() if t.item(row, c) else ""
                     for c in range(len(FLEET_COLUMNS))]
            if not any(cells):
                continue
            try:
                out.append(parse_instance([cells[0], cells[1]] + [c or "-" for c in cells[2:]]))
            except ValueError as e:
                raise ValueError(f"row {row + 1}: {e}") from None
        if not out:
            raise ValueError("the fleet has no instances: Add a row or Load a fleet file")
        check_fleet(out)
        return out

    # ----------------------------------------------------------------- either
    def _browse(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Record the attached session to",
                                              "attached.kvscope", "kvscope sessions (*.kvscope)")
        if path:
            self.record.setText(path)

    def options(self) -> dict:
        """MainWindow.attach's arguments; ValueError when the fleet's cannot be used."""
        shared = dict(topic=self.topic.text(), record=self.record.text().strip(),
                      slots=self.slots.value())
        if self.tabs.currentIndex() == 1:
            return dict(fleet=self.instances(), **shared)
        return dict(endpoint=self.endpoint.text().strip(), replay=self.replay.text().strip(),
                    metrics=self.metrics.text().strip(), **shared)

    def _say(self, error: str) -> None:
        self.error.setText(error)
        self.error.setToolTip(error)
        self.error.setVisible(bool(error))

    def _accept(self) -> None:
        try:
            options = self.options()
        except ValueError as e:
            self._say(str(e))
            return
        self._say("")
        self.accept()
        self.attach_requested.emit(options)
