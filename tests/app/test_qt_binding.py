"""Guards the PySide6 pin: PySide6 6.12.0 on Python 3.11 drops a reference to None on every
call of a method returning None, so a long session (or a test run) dies with "deallocating
None". Python 3.12+ hides this (None is immortal there)."""

import sys

from PySide6.QtWidgets import QLabel


def test_void_qt_calls_keep_none_alive(qapp):
    label = QLabel()
    before = sys.getrefcount(None)
    for _ in range(2000):
        label.setText("x")
    assert sys.getrefcount(None) - before > -100
