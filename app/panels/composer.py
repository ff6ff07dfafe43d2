"""Prompt composer: submits a request (text, max tokens, temperature, n, salt) at any time."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QDoubleSpinBox,
    QGridLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from kvscope.engine.config import SamplingParams


class Composer(QWidget):
    submitted = Signal(str, object, object)  # prompt, SamplingParams, cache salt or None

    def __init__(self, parent=None):
        super().__init__(parent)
        self.prompt = QPlainTextEdit()
        self.prompt.setPlaceholderText("Type a prompt, then Ctrl+Enter or Submit")
        self.max_tokens = QSpinBox(minimum=1, maximum=4096, value=64)
        self.temperature = QDoubleSpinBox(minimum=0.0, maximum=5.0, singleStep=0.1, value=0.0)
        self.temperature.setToolTip("0 = greedy")
        self.n = QSpinBox(minimum=1, maximum=16, value=1)
        self.n.setToolTip("Parallel samples: they share the prompt's blocks (copy-on-write)")
        self.salt = QLineEdit()
        self.salt.setPlaceholderText("none")
        self.salt.setToolTip("Cache salt (tenant): requests with different salts never share "
                             "blocks")
        self.submit_button = QPushButton("Submit")
        self.submit_button.setShortcut("Ctrl+Return")
        self.submit_button.clicked.connect(self.submit)
        grid = QGridLayout()  # two fields a row: the dock leaves the requests table its rows
        for i, (label, field) in enumerate([("max tokens", self.max_tokens),
                                            ("temperature", self.temperature),
                                            ("n", self.n), ("cache salt", self.salt)]):
            grid.addWidget(QLabel(label), i // 2, 2 * (i % 2))
            grid.addWidget(field, i // 2, 2 * (i % 2) + 1)
        grid.addWidget(self.submit_button, 0, 4, 2, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addWidget(self.prompt, 1)
        layout.addLayout(grid)

    def set_read_only(self, why: str | None) -> None:
        """Submitting is off (with `why` as the tooltip) while the source cannot change."""
        self.submit_button.setEnabled(why is None)
        self.prompt.setReadOnly(why is not None)
        self.submit_button.setToolTip(why or "Submit the prompt (Ctrl+Enter)")

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens.value(),
                              temperature=self.temperature.value(), n=self.n.value())

    def submit(self) -> None:
        text = self.prompt.toPlainText()
        if text.strip():
            self.submitted.emit(text, self.params(), self.salt.text().strip() or None)
