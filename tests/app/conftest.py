"""GUI tests drive the real window, offscreen, with the demo model in its engine process
(helpers in window_testutil.py)."""

from __future__ import annotations

import pytest
from window_testutil import open_window


@pytest.fixture
def window(qtbot, tmp_path):
    w = open_window(qtbot, tmp_path)
    yield w
    w.close()
