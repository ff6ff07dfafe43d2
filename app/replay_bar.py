"""The replay scrubber: slider, play/pause, speed, step ±1, jump to the next eviction,
preemption or cancellation. It only picks steps; the window renders them."""

from __future__ import annotations

import bisect

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QPushButton, QSlider, QWidget

from kvscope.app.selection import Selection
from kvscope.engine import events as ev

SPEEDS = {"0.5×": 5, "1×": 10, "2×": 20, "4×": 40, "8×": 80}  # steps per second
JUMPS = {"eviction": ev.EVICTED, "preemption": ev.PREEMPTED, "cancellation": ev.CANCELLED}


class ReplayBar(QWidget):
    step_changed = Signal(int)
    leave_requested = Signal()

    def __init__(self, selection: Selection | None = None, parent=None):
        super().__init__(parent)
        self.selection = selection or Selection()
        self.slider = QSlider(Qt.Horizontal)
        self.slider.valueChanged.connect(self.step_changed)
        self.step_changed.connect(self.selection.select_step)
        self.selection.step_changed.connect(self._on_cursor)
        self.play_button = QPushButton("▶ Play")
        self.play_button.setCheckable(True)
        self.play_button.toggled.connect(self._on_play)
        self.speed = QComboBox()
        self.speed.addItems(list(SPEEDS))
        self.speed.setCurrentText("1×")
        self.speed.currentTextChanged.connect(self._on_speed)
        self.prev_button = QPushButton("◀")
        self.next_button = QPushButton("▶|")
        self.prev_button.setToolTip("Previous step (←)")
        self.next_button.setToolTip("Next step (→ or N)")
        self.prev_button.clicked.connect(lambda: self.step_by(-1))
        self.next_button.clicked.connect(lambda: self.step_by(1))
        self.jump_kind = QComboBox()
        self.jump_kind.addItems(list(JUMPS))
        self.jump_button = QPushButton("next ⤼")
        self.jump_button.setToolTip("Jump to the next step with this kind of event")
        self.jump_button.clicked.connect(self.jump_next)
        self.label = QLabel()
        self.leave_button = QPushButton("Back to live")
        self.leave_button.clicked.connect(self.leave_requested)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(4, 2, 4, 2)
        for w in (QLabel("Replay"), self.play_button, self.speed, self.prev_button,
                  self.next_button):
            layout.addWidget(w)
        layout.addWidget(self.slider, 1)
        for w in (self.label, self.jump_kind, self.jump_button, self.leave_button):
            layout.addWidget(w)
        self.timer = QTimer(self)
        self.timer.timeout.connect(self._tick)
        self.steps_with: dict[str, list[int]] = {}

    def set_session(self, first: int, last: int, events: list[ev.Event]) -> None:
        self.play_button.setChecked(False)
        self.steps_with = {kind: sorted({e.step for e in events if e.kind == kind})
                           for kind in JUMPS.values()}
        self.slider.blockSignals(True)
        self.slider.setRange(first, last)
        self.slider.setValue(first)
        self.slider.blockSignals(False)
        self._on_speed(self.speed.currentText())

    def _on_cursor(self, step: int | None) -> None:
        """The time cursor moved (here or in another panel): the slider follows, silently."""
        if step is None:
            return
        self.slider.blockSignals(True)
        self.slider.setValue(step)
        self.slider.blockSignals(False)
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

    def jump_next(self) -> None:
        target = self.next_step_with(JUMPS[self.jump_kind.currentText()])
        if target is None:
            self.label.setText(f"no later {self.jump_kind.currentText()}")
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
