"""Prompt composer: submits a request (text, max tokens, temperature, n, salt) at any time.

In chat mode it keeps a conversation: each turn sends the messages so far (the earlier answers
as text) plus the new one, which the engine process formats with the model's chat template, as a
chat client resends its history to a server; the cache reuses the earlier turns' blocks. The
transcript always shows the last exchange; another model starts a new chat, and a model without
a chat template cannot chat (the box says why)."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtGui import QTextCursor
from PySide6.QtWidgets import (
    QCheckBox,
    QDoubleSpinBox,
    QFrame,
    QGridLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from kvscope.app.frames import Frame
from kvscope.engine.config import SamplingParams

CHAT_TIP = ("Apply the model's chat template; each turn resends the conversation so far, so the "
            "earlier turns' blocks are reused")
TRANSCRIPT_LINES = 3  # the least the transcript shows: a question and two lines of its answer
TRANSCRIPT_MAX_LINES = 12  # it asks for room to show the last exchange up to this many lines


class Composer(QWidget):
    submitted = Signal(object, object, object)  # text or chat messages, SamplingParams, salt
    wants_room = Signal()  # chat toggled or the transcript grew: it shows more in a taller dock

    def __init__(self, parent=None):
        super().__init__(parent)
        self.messages: list[dict] = []  # the conversation so far (chat mode)
        self._sent: list[dict] | None = None  # the turn waiting for its answer
        self._answer_id: int | None = None  # that turn's request id, once the engine says it
        self.model: str | None = None  # the model the conversation is with
        self._last_start = 0  # where the transcript's last exchange starts
        self.chat = QCheckBox("chat")
        self.chat.setToolTip(CHAT_TIP)
        self.transcript = QPlainTextEdit(readOnly=True, visible=False)
        self.new_chat_button = QPushButton("New chat", visible=False)
        self.new_chat_button.clicked.connect(self.new_chat)
        self.chat.toggled.connect(self.transcript.setVisible)
        self.chat.toggled.connect(self.new_chat_button.setVisible)
        self.chat.toggled.connect(lambda _on: self.wants_room.emit())
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
        grid.setVerticalSpacing(3)
        for i, (label, field) in enumerate([("max tokens", self.max_tokens),
                                            ("temperature", self.temperature),
                                            ("n", self.n), ("cache salt", self.salt)]):
            grid.addWidget(QLabel(label), i // 2, 2 * (i % 2))
            grid.addWidget(field, i // 2, 2 * (i % 2) + 1)
        grid.addWidget(self.submit_button, 0, 4, 1, 2)
        grid.addWidget(self.chat, 1, 4)  # beside the fields: two rows, the transcript the rest
        grid.addWidget(self.new_chat_button, 1, 5)
        # the two text boxes give way first
        for box, lines in ((self.transcript, TRANSCRIPT_LINES), (self.prompt, 2)):
            box.setMinimumHeight(lines * box.fontMetrics().lineSpacing()
                                 + 2 * box.frameWidth() + 8)
        self.form = QWidget()
        layout = QVBoxLayout(self.form)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.setSpacing(4)
        layout.addWidget(self.transcript, 3)
        layout.addWidget(self.prompt, 1)
        layout.addLayout(grid)
        # A dock shorter than the form scrolls it: the fields keep their height, never squeezed
        # to unreadable slivers (a small window cannot give every dock its minimum).
        scroll = QScrollArea(widgetResizable=True, frameShape=QFrame.NoFrame)
        scroll.setWidget(self.form)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(scroll)

    def needed_height(self) -> int:
        """The height that shows every field unscrolled; in chat mode, and the transcript's last
        exchange (up to TRANSCRIPT_MAX_LINES lines)."""
        need = self.form.minimumSizeHint().height()
        if not self.chat.isChecked():
            return need
        edit, doc = self.transcript, self.transcript.document()
        block, height = doc.findBlock(self._last_start), 0.0
        while block.isValid():
            height += edit.blockBoundingRect(block).height()
            block = block.next()
        shown = min(height, TRANSCRIPT_MAX_LINES * edit.fontMetrics().lineSpacing())
        extra = shown + 2 * (edit.frameWidth() + doc.documentMargin()) - edit.minimumHeight()
        return need + max(0, int(extra))

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
        if not text.strip():
            return
        if not self.chat.isChecked():
            self.submitted.emit(text, self.params(), self.salt.text().strip() or None)
            return
        if self._sent is not None:
            return  # one turn at a time: the next one resends this one's answer
        self._sent = self.messages + [{"role": "user", "content": text}]
        self.prompt.clear()
        self._show_transcript()
        self.submitted.emit(self._sent, self.params(), self.salt.text().strip() or None)

    def new_chat(self) -> None:
        self.messages, self._sent, self._answer_id = [], None, None
        self._show_transcript()

    def set_model(self, name: str, chats: bool) -> None:
        """A model loaded. A conversation with another model starts over (its answers were that
        model's); chats: the model has a chat template, else the chat box is off and says why."""
        if name != self.model:
            self.model = name
            self.new_chat()
        self.transcript.setPlaceholderText(f"A new chat with {name}: type below, then Submit")
        if not chats:
            self.chat.setChecked(False)
        self.chat.setEnabled(chats)
        self.chat.setToolTip(CHAT_TIP if chats else
                             f"{name} has no chat template: pick SmolLM2-135M-Instruct (real) in "
                             "the Model list to chat")

    def on_submitted(self, request_id: int) -> None:
        """The engine queued a request: in chat mode, the turn waiting for its answer."""
        if self._sent is not None and self._answer_id is None:
            self._answer_id = request_id

    def on_rejected(self) -> None:
        if self._sent is not None and self._answer_id is None:
            self.prompt.setPlainText(self._sent[-1]["content"])  # nothing typed is lost
            self._sent = None
            self._show_transcript()

    def show_frame(self, frame: Frame) -> None:
        if frame.requests is not None:
            self.show_requests(frame.requests)  # a chat turn's answer

    def clear(self) -> None:
        """The conversation is the user's: it stays whichever source is shown."""

    def show_requests(self, rows) -> None:
        """Take the waiting turn's answer from the request rows once it has finished."""
        row = next((r for r in rows if r.request_id == self._answer_id), None)
        if row is None or not row.state.startswith("finished"):
            return
        if row.state.removeprefix("finished: ") in ("stop", "eos", "length"):
            self.messages = self._sent + [{"role": "assistant", "content": row.text}]
        self._sent, self._answer_id = None, None
        self._show_transcript()

    def _show_transcript(self) -> None:
        """One line a message, a blank line between exchanges; the last exchange in view."""
        turns = self.messages if self._sent is None else self._sent + [
            {"role": "assistant", "content": "…"}]
        text, self._last_start = "", 0
        for m in turns:
            if m["role"] == "user" and text:
                text += "\n\n"
                self._last_start = len(text)
            elif text:
                text += "\n"
            text += f"{m['role']}: {m['content'].strip()}"
        self.transcript.setPlainText(text)
        # The end in view, then the last question's start if the last exchange is taller.
        cursor = QTextCursor(self.transcript.document())
        for position in (len(text), self._last_start):
            cursor.setPosition(position)
            self.transcript.setTextCursor(cursor)
            self.transcript.ensureCursorVisible()
        self.wants_room.emit()
