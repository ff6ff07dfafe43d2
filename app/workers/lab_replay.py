"""The what-if replay the window opens, made (the trace read) and run in one pass
(`kvscope.lab.replay.WhatIfReplay.run`) on a QThread, with progress, stopped by `cancel()` within
a step (the lab panel's own runs are worker processes: lab.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

from PySide6.QtCore import QThread, Signal

from kvscope.lab.replay import WhatIfReplay

YIELD_S = 0.001


class ReplayThread(QThread):
    """Makes the replay (`make()`: the trace read, the run set up) and runs it; when it ends
    (`finished`), `ok` says whether the run completed and `error` holds why it failed (a bad
    trace too), if it did."""

    sized = Signal(int)  # the replay is made: its number of steps
    progressed = Signal(int)  # steps done

    def __init__(self, make: Callable[[], WhatIfReplay], parent=None):
        super().__init__(parent)
        self.make = make
        self.replay: WhatIfReplay | None = None
        self.ok = False
        self.error: str | None = None
        self._cancelled = False

    def run(self) -> None:
        try:
            self.replay = self.make()
            self.sized.emit(self.replay.num_steps)
            self.ok = self.replay.run(lambda done, _n: self.progressed.emit(done),
                                      self._stopped)
        except Exception as e:  # noqa: BLE001 - shown in the banner, the window keeps running
            self.error = str(e) or type(e).__name__

    def _stopped(self) -> bool:
        """Asked once a step: a moment without the GIL for the GUI thread, then whether to
        stop. (Without it the GUI thread, woken by a timer, could wait a second for the GIL
        on a busy machine.)"""
        time.sleep(YIELD_S)
        return self._cancelled

    def cancel(self) -> None:
        self._cancelled = True
