"""Helpers for the GUI tests (a uniquely named module, so imports are unambiguous under
pytest-xdist): the real window, offscreen, with the demo model in its engine process."""

from __future__ import annotations

from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from kvscope.app.window.main_window import MainWindow

LOAD_TIMEOUT_MS = 30_000



def open_window(qtbot, tmp_path, engine_setup: str | None = None) -> MainWindow:
    """The window with the demo model loaded in its engine process."""
    settings = QSettings(str(tmp_path / "kvscope.ini"), QSettings.IniFormat)
    w = MainWindow(settings=settings, engine_setup=engine_setup)
    qtbot.addWidget(w)
    w.resize(1400, 900)
    w.blocks_box.setValue(256)
    w.pace_box.setValue(0)  # tests run at full speed; test_layout.py checks the pacing
    w.show()
    w.load_model("demo")
    qtbot.waitUntil(lambda: w.engine is not None, timeout=LOAD_TIMEOUT_MS)
    return w


def bare_window(qtbot, tmp_path, size=(1280, 720), name="k.ini") -> MainWindow:
    """The window without a model (no engine process), shown at a size."""
    w = MainWindow(settings=QSettings(str(tmp_path / name), QSettings.IniFormat))
    qtbot.addWidget(w)
    w.resize(*size)
    w.show()
    qtbot.waitExposed(w)
    return w


def open_replay(qtbot, tmp_path, session, size=(1400, 900)) -> MainWindow:
    """The window as `kvscope replay FILE` opens it: no model loaded."""
    w = bare_window(qtbot, tmp_path, size)
    assert w.open_session(str(session))
    return w


def shown(qtbot, widget: QWidget, size: tuple[int, int]) -> QWidget:
    """`widget` on its own, shown at a size."""
    qtbot.addWidget(widget)
    widget.resize(*size)
    widget.show()
    qtbot.waitExposed(widget)
    return widget


def beside_a_label(qtbot, widget: QWidget, size: tuple[int, int]) -> tuple[QWidget, QLabel]:
    """Shows `widget` above a label (somewhere for the mouse to leave to) in a box: (box, label).
    Keep the box: the widgets are deleted with it."""
    box = QWidget()
    other = QLabel("elsewhere")
    layout = QVBoxLayout(box)
    layout.addWidget(widget, 1)
    layout.addWidget(other)
    qtbot.addWidget(box)
    box.resize(*size)
    box.show()
    qtbot.waitExposed(box)
    return box, other


def step(window, qtbot, n: int = 1) -> None:
    """Run n engine steps in the engine process and wait until the GUI has pulled the last frame."""
    target = window.engine.num_steps + n
    for _ in range(n):
        window.engine_client.step_once()
    qtbot.waitUntil(lambda: window.engine.num_steps >= target, timeout=20_000)
    # Wait for the frame that carries the last step's record (a frame published before the
    # first step also says step 0).
    qtbot.waitUntil(lambda: len(window.timeline.data["step"]) and
                    window.timeline.data["step"][-1] == target - 1, timeout=5_000)


def pause(window, qtbot) -> None:
    """Pause the live run and wait until the engine process says it paused and the window shows
    the last step it ran (the frames of the steps run until then arrive after the request)."""
    window.pause()
    qtbot.waitUntil(lambda: not window.running, timeout=10_000)
    qtbot.waitUntil(lambda: window.snapshot.step == window.engine.num_steps - 1, timeout=5_000)


def tree_blocks(w) -> int:
    """Blocks in the prefix tree panel once it has caught up with the newest frame."""
    from kvscope.app.prefix_tree import walk

    while w.tree.pending:
        w.tree.advance()
    w.tree.flush()
    return sum(n.count for root in w.tree.forest for n in walk(root.children))
