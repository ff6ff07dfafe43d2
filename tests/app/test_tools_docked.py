"""Issue 26, item 8: the tools (Cache lab, Experiments) and the View menu, which lists the
docks as the user meets them, then the tools."""

from __future__ import annotations

import pytest

SIZES = [(1280, 720), (1600, 1000)]
IDS = ["1280x720", "1600x1000"]


def view_menu_groups(w) -> list[list[str]]:
    """The View menu's entries, in groups between separators."""
    groups = [[]]
    for action in w.view_menu.actions():
        if action.isSeparator():
            groups.append([])
        else:
            groups[-1].append(action.text())
    return groups


@pytest.mark.parametrize("size", SIZES, ids=IDS)
def test_the_view_menu_lists_the_docks_as_the_user_meets_them_then_the_tools(
        qtbot, tmp_path, size):
    from window_testutil import bare_window

    w = bare_window(qtbot, tmp_path, size)
    docks, tools, *_ = view_menu_groups(w)
    # left column; right column: the tree's tabs, then Details' tabs; the bottom's tabs
    assert docks == ["Requests", "Prompt", "Prefix tree", "Capacity", "Device",
                     "Details / Why it missed", "Text", "Timeline", "Events"]
    assert tools == ["Cache lab", "Experiments"]
    shortcuts = {a.text(): a.shortcut().toString() for a in w.view_menu.actions()}
    assert shortcuts["Cache lab"] == "Ctrl+Shift+L" and shortcuts["Experiments"] == "Ctrl+Shift+E"
    w.close()
