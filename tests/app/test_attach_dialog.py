"""File → Attach…'s fleet tab: named servers in a small table, typed in or loaded from a fleet
file; what cannot be used is said in one line and the dialog stays open; Attach shows the fleet."""

from __future__ import annotations

import sys
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialogButtonBox, QFileDialog
from test_fleet_window import SHOTS, column
from window_testutil import bare_window

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sessions"))
from kv_fake_publisher import batch, stored  # noqa: E402


def press_attach(qtbot, dialog):
    qtbot.mouseClick(dialog.buttons.button(QDialogButtonBox.Ok), Qt.LeftButton)


def test_the_fleet_tab_takes_named_servers_and_says_what_is_wrong(qtbot, tmp_path, fakes,
                                                                   monkeypatch):
    w = bare_window(qtbot, tmp_path, (1280, 720))
    d = w.attach_dialog()
    qtbot.waitExposed(d)
    bar = d.tabs.tabBar()
    qtbot.mouseClick(bar, Qt.LeftButton, pos=bar.tabRect(1).center())
    assert d.tabs.currentIndex() == 1
    # nothing in the table yet
    press_attach(qtbot, d)
    assert d.isVisible() and "no instances" in d.error.text()
    # a fleet file with a bad line: its line named, in one line
    fleet = tmp_path / "fleet.txt"
    fleet.write_text(f"a {fakes[0].endpoint}\nb/x {fakes[1].endpoint}\n")
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *a, **k: (str(fleet), ""))
    qtbot.mouseClick(d.load_button, Qt.LeftButton)
    assert "line 2" in d.error.text() and "name 'b/x'" in d.error.text()
    assert "\n" not in d.error.text() and d.fleet.rowCount() == 0
    # a good one fills the table
    fleet.write_text(f"# two\na {fakes[0].endpoint} {fakes[0].replay_endpoint}\n"
                     f"b {fakes[1].endpoint}  # no replay\n")
    qtbot.mouseClick(d.load_button, Qt.LeftButton)
    assert not d.error.isVisible() and d.fleet.rowCount() == 2
    assert d.fleet.item(0, 2).text() == fakes[0].replay_endpoint
    # a row added by hand with the same name: said, the dialog stays
    qtbot.mouseClick(d.add_button, Qt.LeftButton)
    d.fleet.item(2, 0).setText("a")
    d.fleet.item(2, 1).setText("tcp://127.0.0.1:1")
    press_attach(qtbot, d)
    assert d.isVisible() and d.error.text() == "two instances have the name 'a'"
    d.fleet.item(2, 0).setText("c")
    d.fleet.item(2, 1).setText("127.0.0.1:1")
    press_attach(qtbot, d)
    assert d.error.text().startswith("row 3: endpoint '127.0.0.1:1' is not a ZMQ address")
    SHOTS.mkdir(exist_ok=True)
    d.grab().save(str(SHOTS / "attach_dialog_fleet.png"))
    d.fleet.selectRow(2)
    qtbot.mouseClick(d.remove_button, Qt.LeftButton)
    assert d.fleet.rowCount() == 2
    d.slots.setValue(64)
    press_attach(qtbot, d)
    assert not d.isVisible()
    table = w.fleet_view.table
    assert table.isVisible() and column(table, 1) == ["all instances", "a", "b"]
    for f in fakes[:2]:
        f.wait_subscribed(timeout_s=10)
    fakes[0].send(0, batch([stored([1, 2], None)]))
    fakes[1].send(0, batch([stored([1], None)]))
    qtbot.waitUntil(lambda: column(table, 2) == ["3", "2", "1"], timeout=5000)
    assert w.snapshot.num_blocks == 64
    w.close()
