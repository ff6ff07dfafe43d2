"""The timeline's "Export this range": steps first..last of the session behind the window (the
replayed file, or the live engine's history) to a file the user picks, a Chrome trace (.json,
for ui.perfetto.dev) or one row per step (.csv). Never over the session, never over an existing
file without asking. `ask_path` and `confirm_overwrite` are the seams tests replace."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication, QFileDialog, QMessageBox, QWidget

from kvscope.sessions import SessionError
from kvscope.sessions.export import check_output, export_range

TRACE_FILTER = "Chrome trace for ui.perfetto.dev (*.json)"
CSV_FILTER = "One row per step (*.csv)"


class RangeExporter:
    def __init__(self, parent: QWidget, session: Callable[[], str | None],
                 error: Callable[[str], None], note: Callable[[str], None]):
        """session: the file behind the steps shown now (None: none); error and note: how
        the window shows a failure and a result."""
        self.parent, self.session, self.error, self.note = parent, session, error, note

    def ask_path(self, suggested: str) -> tuple[str, str]:
        """(path, chosen filter); an empty path: cancelled."""
        return QFileDialog.getSaveFileName(
            self.parent, "Export this range of steps", suggested, f"{TRACE_FILTER};;{CSV_FILTER}",
            options=QFileDialog.DontConfirmOverwrite)  # asked below, the same on every platform

    def confirm_overwrite(self, path: Path) -> bool:
        return QMessageBox.question(
            self.parent, "Replace the file?", f"{path} exists. Replace it?",
            QMessageBox.Yes | QMessageBox.No, QMessageBox.No) == QMessageBox.Yes

    def export(self, first: int, last: int) -> Path | None:
        """Ask where, then write; the path written (None: nothing was)."""
        session = self.session()
        if session is None:
            self.error("Nothing to export: these steps come from no session file (record the "
                       "run, or open a session)")
            return None
        folder = Path(session).parent if Path(session).parent.is_dir() else Path.home()
        name = f"{Path(session).stem}-steps-{first}-{last}.json"
        path, chosen = self.ask_path(str(folder / name))
        if not path:
            return None
        out = Path(path)
        if out.suffix.lower() not in (".json", ".csv"):
            out = out.with_name(out.name + (".csv" if chosen == CSV_FILTER else ".json"))
        try:  # the path as chosen too: the session itself, given a suffix, is still refused
            check_output(session, path)
            check_output(session, out)  # before asking whether to replace it
        except ValueError as e:
            self.error(f"Export refused: {e}")
            return None
        if out.exists() and not self.confirm_overwrite(out):
            return None
        QApplication.setOverrideCursor(Qt.WaitCursor)
        try:
            lo, hi = export_range(session, out, first, last, overwrite=True)
        except (ValueError, SessionError, OSError) as e:
            self.error(f"Export failed: {e}")
            return None
        finally:
            QApplication.restoreOverrideCursor()
        later = (f"; steps {hi + 1}–{last} were not saved yet, export again in a moment"
                 if hi < last else "")
        self.note(f"wrote steps {lo}–{hi} ({hi - lo + 1}) to {out}{later}")
        return out
