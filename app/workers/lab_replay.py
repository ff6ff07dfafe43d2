"""The one pass of a what-if replay the window opens (`kvscope.lab.replay.WhatIfReplay.run`) on
a QThread, with progress, stopped by `cancel()` within a step (the lab panel's own runs are
worker processes: lab.py)."""

from __future__ import annotations

from PySide6.QtCore import QThread, Signal

from kvscope.lab.replay import WhatIfReplay


class ReplayThread(QThread):
    """Runs `replay.run()`; when it ends (`finished`), `ok` says whether the run completed and
    `error` holds why it failed, if it did."""

    progressed = Signal(int)  # steps done

    def __init__(self, replay: WhatIfReplay, parent=None):
        super().__init__(parent)
        self.replay = replay
        self.ok = False
        self.error: str | None = None
        self._cancelled = False

    def run(self) -> None:
        try:
            self.ok = self.replay.run(lambda done, _n: self.progressed.emit(done),
                                      lambda: self._cancelled)
        except Exception as e:  # noqa: BLE001 - shown in the banner, the window keeps running
            self.error = str(e) or type(e).__name__

    def cancel(self) -> None:
        self._cancelled = True
