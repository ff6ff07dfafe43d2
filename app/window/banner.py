"""A non-modal error banner at the top of the window: the message, details one click away."""

from __future__ import annotations

from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QMessageBox, QPushButton

from kvscope.app import palette


class ErrorBanner(QFrame):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.setStyleSheet(f"QFrame {{ background: #fbe3d6; border: 1px solid "
                           f"{palette.EVICTED_COLOR}; }} QLabel {{ border: none; }}")
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.label.setMinimumWidth(1)  # a long path in a message is cut (whole in its tooltip),
        #                                never widens the window
        self.details_button = QPushButton("Details…")
        self.close_button = QPushButton("Dismiss")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(6, 3, 6, 3)
        layout.addWidget(self.label, 1)
        layout.addWidget(self.details_button)
        layout.addWidget(self.close_button)
        self.details_button.clicked.connect(self._show_details)
        self.close_button.clicked.connect(self.hide)
        self.detail = ""
        self.hide()

    def show_error(self, message: str, detail: str = "") -> None:
        self.label.setText(message)
        self.label.setToolTip(message)
        self.detail = detail
        self.details_button.setVisible(bool(detail))
        self.show()

    def _show_details(self) -> None:
        box = QMessageBox(QMessageBox.Warning, "Error details", self.label.text(),
                          QMessageBox.Close, self)
        box.setDetailedText(self.detail)
        box.setModal(False)
        box.show()
