"""The exporter seam: one row added to `sessions.export.EXPORTERS` is a `kvscope export` flag (in
its help too), a filter of the window's File → Export… dialog and of the timeline's range
export, and writes what it writes from each of them."""

from __future__ import annotations

from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from test_timeline_export import drag_range
from window_testutil import open_replay

from kvscope.app.cli.main import main
from kvscope.sessions import export as export_mod
from kvscope.sessions.export import Exporter


def _tokens(reader, out: Path) -> list[Path]:
    out.write_text("".join(f"{s.step} {s.prefill_tokens + s.decode_tokens}\n"
                           for s in reader.steps()))
    return [out]


def _tokens_range(reader, out: Path, lo: int, hi: int) -> None:
    out.write_text("".join(f"{s.step}\n" for s in reader.steps(lo, hi)))


DUMMY = Exporter("tokens-txt", "OUT.txt", "Tokens per step, as text", ".txt", _tokens,
                 note="(one line per step)", range_title="Step numbers", range_suffix=".txt",
                 write_range=_tokens_range)


@pytest.fixture
def with_dummy(monkeypatch):
    monkeypatch.setattr(export_mod, "EXPORTERS", [*export_mod.EXPORTERS, DUMMY])


def test_a_new_exporter_is_a_cli_flag(with_dummy, session, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    assert "--tokens-txt OUT.txt" in capsys.readouterr().out
    out = tmp_path / "tokens.txt"
    assert main(["export", str(session), "--tokens-txt", str(out)]) == 0
    assert f"wrote {out} (one line per step)" in capsys.readouterr().out
    lines = out.read_text().splitlines()
    assert len(lines) > 10 and all(len(line.split()) == 2 for line in lines)
    # never over the session, like every exporter
    before = session.read_bytes()
    assert main(["export", str(session), "--tokens-txt", str(session)]) == 2
    assert "refusing to overwrite the input" in capsys.readouterr().err
    assert session.read_bytes() == before


def test_a_new_exporter_is_in_both_export_dialogs(with_dummy, qtbot, tmp_path, session):
    w = open_replay(qtbot, tmp_path, session)
    asked = []

    def ask(out):
        def ask_path(title, suggested, filters):
            asked.append(filters)
            return str(out), next(f for f in filters if "*.txt" in f)
        return ask_path

    # File → Export… (Ctrl+E): the filter is there; a name without a suffix gets .txt
    w.range_export.ask_path = ask(tmp_path / "whole")
    w.activateWindow()
    qtbot.waitUntil(w.isActiveWindow)
    qtbot.keyClick(w.pool, Qt.Key_E, Qt.ControlModifier)
    assert asked[-1][-1] == "Tokens per step, as text (*.txt)"
    assert len(asked[-1]) == 3  # the two built in, and this one
    assert len((tmp_path / "whole.txt").read_text().splitlines()) > 10
    # the timeline's range export: its range filter, exactly the steps of the range
    w.range_export.ask_path = ask(tmp_path / "range")
    drag_range(w.timeline, qtbot, 3, 7.3)
    qtbot.mouseClick(w.timeline.export_button, Qt.LeftButton)
    assert asked[-1][-1] == "Step numbers (*.txt)"
    assert (tmp_path / "range.txt").read_text().split() == [str(s) for s in range(3, 8)]
    w.close()
