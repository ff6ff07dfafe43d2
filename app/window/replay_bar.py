"""The replay scrubber: a full-width slider; first/last step, step ±1, a step field, play and
speed, the previous/next eviction, preemption or cancellation. It only picks steps; the window
renders them. Its controls wrap onto more rows where the bar is narrow: it never widens the
window. While it is shown it takes the keys of the live engine's actions (off in replay): F5 and
Space play and pause, N and → the next step, End the last."""

from __future__ import annotations

import bisect

from PySide6.QtCore import QPoint, QRect, QSize, Qt, QTimer, Signal
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QLayout,
    QSlider,
    QSpinBox,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from kvscope.app.selection import Selection
from kvscope.engine import events as ev

SPEEDS = {"0.5×": 5, "1×": 10, "2×": 20, "4×": 40, "8×": 80}  # steps per second
JUMPS = {"eviction": ev.EVICTED, "preemption": ev.PREEMPTED, "cancellation": ev.CANCELLED}


class FlowLayout(QLayout):
    """Its items left to right, wrapped onto a new row where the next would not fit: as narrow as
    its widest item, as tall as its rows at the width it has."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.items = []
        self.setContentsMargins(0, 0, 0, 0)
        self.setSpacing(6)

    def addItem(self, item) -> None:  # noqa: N802 - Qt API
        self.items.append(item)

    def count(self) -> int:
        return len(self.items)

    def itemAt(self, i: int):  # noqa: N802 - Qt API
        return self.items[i] if 0 <= i < len(self.items) else None

    def takeAt(self, i: int):  # noqa: N802 - Qt API
        return self.items.pop(i) if 0 <= i < len(self.items) else None

    def expandingDirections(self):  # noqa: N802 - Qt API
        return Qt.Orientation(0)

    def hasHeightForWidth(self) -> bool:  # noqa: N802 - Qt API
        return True

    def heightForWidth(self, width: int) -> int:  # noqa: N802 - Qt API
        return self._place(QRect(0, 0, width, 0), move=False)

    def setGeometry(self, rect: QRect) -> None:  # noqa: N802 - Qt API
        super().setGeometry(rect)
        self._place(rect, move=True)

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt API
        return self.minimumSize()

    def minimumSize(self) -> QSize:  # noqa: N802 - Qt API
        size = QSize(0, 0)
        for item in self.items:
            size = size.expandedTo(item.sizeHint())
        return size

    def _place(self, rect: QRect, move: bool) -> int:
        """Lays the items out in rect (move: for real); the height they take."""
        x, y, row = rect.x(), rect.y(), 0
        for item in self.items:
            hint = item.sizeHint()
            if x > rect.x() and x + hint.width() > rect.right() + 1:
                x, y, row = rect.x(), y + row + self.spacing(), 0
            if move:
                item.setGeometry(QRect(QPoint(x, y), hint))
            x += hint.width() + self.spacing()
            row = max(row, hint.height())
        return y + row - rect.y()


def _group(*widgets: QWidget) -> QWidget:
    """Controls that belong together: wrapped as one."""
    box = QWidget()
    row = QHBoxLayout(box)
    row.setContentsMargins(0, 0, 0, 0)
    row.setSpacing(2)
    for w in widgets:
        row.addWidget(w)
    return box


class ReplayBar(QWidget):
    step_changed = Signal(int)
    leave_requested = Signal()

    def __init__(self, selection: Selection | None = None, parent=None):
        super().__init__(parent)
        self.selection = selection or Selection()
        self.slider = QSlider(Qt.Horizontal)
        self.slider.setMinimumWidth(120)
        self.slider.valueChanged.connect(self.step_changed)
        self.step_changed.connect(self.selection.select_step)
        self.selection.step_changed.connect(self._on_cursor)
        self.play_button = QToolButton()
        self.play_button.setText("▶ Play")
        self.play_button.setCheckable(True)
        self.play_button.setToolTip("Play or pause the replay (F5 or Space)")
        self.play_button.toggled.connect(self._on_play)
        self.speed = QComboBox()
        self.speed.addItems(list(SPEEDS))
        self.speed.setCurrentText("1×")
        self.speed.setToolTip("Play speed (1× = 10 steps a second)")
        self.speed.currentTextChanged.connect(self._on_speed)
        self.step_field = QSpinBox()
        self.step_field.setToolTip("The step shown: type one and press Enter")
        self.step_field.setKeyboardTracking(False)  # Enter or focus-out moves, not each digit
        self.step_field.valueChanged.connect(self.set_step)
        self.jump_kind = QComboBox()
        self.jump_kind.addItems(list(JUMPS))
        self.label = QLabel()
        self.leave_button = QToolButton()
        self.leave_button.setText("Back to live")
        self.leave_button.clicked.connect(self.leave_requested)
        buttons = [("⇤", "First step (Home)", lambda: self.set_step(self.slider.minimum())),
                   ("◀", "Previous step (←)", lambda: self.step_by(-1)),
                   ("▶|", "Next step (→ or N)", lambda: self.step_by(1)),
                   ("⇥", "Last step (End)", lambda: self.set_step(self.slider.maximum())),
                   ("⤺ prev", "The previous step with this kind of event", self.jump_prev),
                   ("next ⤼", "The next step with this kind of event", self.jump_next)]
        (self.first_button, self.prev_button, self.next_button, self.last_button,
         self.jump_prev_button, self.jump_button) = [
            self._button(text, tip, slot) for text, tip, slot in buttons]
        # The scrubber has a row of its own: it gets the bar's whole width. The controls below
        # wrap, in groups, where the bar is narrow (a small window, wide docks beside it).
        top = QHBoxLayout()
        top.addWidget(QLabel("Replay"))
        top.addWidget(self.slider, 1)
        controls = FlowLayout()
        for group in ((self.first_button, self.prev_button, self.play_button, self.next_button,
                       self.last_button), (QLabel("step"), self.step_field, self.speed),
                      (QLabel("event"), self.jump_kind, self.jump_prev_button, self.jump_button),
                      (self.label,), (self.leave_button,)):
            controls.addWidget(_group(*group))
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 2, 4, 2)
        layout.addLayout(top)
        layout.addLayout(controls)
        # Window-wide while the bar is shown (a hidden widget's shortcuts never fire).
        for key, slot in (("F5", self.play_button.toggle), ("Space", self.play_button.toggle),
                          ("N", self.next_button.click), ("Right", self.next_button.click),
                          ("End", self.last_button.click)):
            QShortcut(QKeySequence(key), self, slot)
        self.timer = QTimer(self)
        self.timer.timeout.connect(self._tick)
        self.steps_with: dict[str, list[int]] = {}

    def _button(self, text: str, tip: str, slot) -> QToolButton:
        button = QToolButton()
        button.setText(text)
        button.setToolTip(tip)
        button.clicked.connect(slot)
        return button

    def set_session(self, first: int, last: int, events: list[ev.Event]) -> None:
        self.play_button.setChecked(False)
        self.steps_with = {kind: sorted({e.step for e in events if e.kind == kind})
                           for kind in JUMPS.values()}
        self.slider.blockSignals(True)
        self.slider.setRange(first, last)
        self.slider.setValue(first)
        self.slider.blockSignals(False)
        self.step_field.blockSignals(True)
        self.step_field.setRange(first, last)
        self.step_field.setValue(first)
        self.step_field.blockSignals(False)
        self._on_speed(self.speed.currentText())

    def _on_cursor(self, step: int | None) -> None:
        """The time cursor moved (here or in another panel): the slider follows, silently."""
        if step is None:
            return
        self.slider.blockSignals(True)
        self.slider.setValue(step)
        self.slider.blockSignals(False)
        self.step_field.blockSignals(True)
        self.step_field.setValue(step)
        self.step_field.blockSignals(False)
        self.label.setText(f"step {step} / {self.slider.maximum()}")

    @property
    def step(self) -> int:
        return self.slider.value()

    def set_step(self, step: int) -> None:
        self.slider.setValue(max(self.slider.minimum(), min(self.slider.maximum(), step)))

    def step_by(self, delta: int) -> None:
        self.set_step(self.step + delta)

    def next_step_with(self, kind: str) -> int | None:
        steps = self.steps_with.get(kind, [])
        i = bisect.bisect_right(steps, self.step)
        return steps[i] if i < len(steps) else None

    def prev_step_with(self, kind: str) -> int | None:
        steps = self.steps_with.get(kind, [])
        i = bisect.bisect_left(steps, self.step)
        return steps[i - 1] if i > 0 else None

    def jump_next(self) -> None:
        self._jump(self.next_step_with(JUMPS[self.jump_kind.currentText()]), "later")

    def jump_prev(self) -> None:
        self._jump(self.prev_step_with(JUMPS[self.jump_kind.currentText()]), "earlier")

    def _jump(self, target: int | None, which: str) -> None:
        if target is None:
            self.label.setText(f"no {which} {self.jump_kind.currentText()}")
        else:
            self.set_step(target)

    def _on_play(self, playing: bool) -> None:
        self.play_button.setText("❚❚ Pause" if playing else "▶ Play")
        if playing:
            self.timer.start()
        else:
            self.timer.stop()

    def _on_speed(self, text: str) -> None:
        self.timer.setInterval(int(1000 / SPEEDS[text]))

    def _tick(self) -> None:
        if self.step >= self.slider.maximum():
            self.play_button.setChecked(False)
        else:
            self.step_by(1)
