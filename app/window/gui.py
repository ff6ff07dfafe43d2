"""Start the desktop application."""

from __future__ import annotations

import sys


def run_gui(model: str = "demo", argv: list[str] | None = None, session: str | None = None,
            attach: dict | None = None) -> int:
    """Open the window with `model` loaded, or replaying `session` (a .kvscope file), or
    attached to a server (`attach`: MainWindow.attach's arguments; the model loads beside)."""
    import pyqtgraph as pg
    from pyqtgraph.util.garbage_collector import GarbageCollector
    from PySide6.QtWidgets import QApplication

    from kvscope.app.window.main_window import MainWindow

    app = QApplication.instance() or QApplication(argv if argv is not None else sys.argv[:1])
    app.setApplicationName("kvscope")
    app.setOrganizationName("kvscope")
    pg.setConfigOptions(antialias=False)
    # Python's collector only from a timer on the GUI thread: a collection that starts inside a
    # Qt call (QObject::disconnect, from pyqtgraph) and frees widgets whose destructors need the
    # lock that call holds hangs the process (seen in the tests, tests/conftest.py).
    collector = GarbageCollector(interval=1.0)  # noqa: F841 - kept alive until exec returns
    window = MainWindow()
    window.show()
    if session is not None:
        window.open_session(session)
    else:
        window.load_model(model)
    if attach is not None:
        window.attach(**attach)
    return app.exec()
