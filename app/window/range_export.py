"""File → Export… (the whole session) and the timeline's "Export this range" (steps first..last
of the session behind the window: the replayed file, or the live engine's history), to a path
the user picks, by any of the exporters in `sessions.export.EXPORTERS` (a Chrome trace for
ui.perfetto.dev, CSV, ...; the dialogs' filters come from that table). Never over the session,
never over an existing file without asking. `ask_path` and `confirm_overwrite` are the seams
tests replace."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication, QFileDialog, QMessageBox, QWidget

from kvscope.sessions import SessionError
from kvscope.sessions import export as exporters
from kvscope.sessions.export import check_output, export_range, export_session, range_exporters


class RangeExporter:
    def __init__(self, parent: QWidget, session: Callable[[], str | None],
                 error: Callable[[str], None], note: Callable[[str], None]):
        """session: the file behind the steps shown now (None: none); error and note: how
        the window shows a failure and a result."""
        self.parent, self.session, self.error, self.note = parent, session, error, note

    def ask_path(self, title: str, suggested: str, filters: list[str]) -> tuple[str, str]:
        """(path, chosen filter); an empty path: cancelled."""
        return QFileDialog.getSaveFileName(
            self.parent, title, suggested, ";;".join(filters),
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
        rows = range_exporters()
        name = f"{Path(session).stem}-steps-{first}-{last}{rows[0].range_suffix}"
        path, chosen = self.ask_path("Export this range of steps", str(_folder(session) / name),
                                     [x.range_filter for x in rows])
        if not path:
            return None
        out = Path(path)
        if out.suffix.lower() not in {x.range_suffix for x in rows}:
            x = next((x for x in rows if x.range_filter == chosen), rows[0])
            out = out.with_name(out.name + x.range_suffix)
        # the path as chosen too: the session itself, given a suffix, is still refused
        steps = self._write(session, [Path(path), out], out,
                            lambda: export_range(session, out, first, last, overwrite=True))
        if steps is None:
            return None
        lo, hi = steps
        later = (f"; steps {hi + 1}–{last} were not saved yet, export again in a moment"
                 if hi < last else "")
        self.note(f"wrote steps {lo}–{hi} ({hi - lo + 1}) to {out}{later}")
        return out

    def export_session(self, session: str | None) -> list[Path]:
        """File → Export…: the whole session, by the exporter whose filter is picked."""
        if session is None:
            self.error("Nothing to export yet: record a session (Ctrl+R) or open one (Ctrl+O).")
            return []
        rows = exporters.EXPORTERS  # the table as it is now
        first = rows[0]
        path, chosen = self.ask_path("Export the session",
                                     str(Path(session).with_suffix(first.suffix)),
                                     [x.dialog_filter for x in rows])
        if not path:
            return []
        x = next((x for x in rows if x.dialog_filter == chosen), first)
        out = Path(path)
        if x.suffix and out.suffix.lower() != x.suffix:
            out = out.with_name(out.name + x.suffix)
        written = self._write(session, x.outputs(out), out if x.suffix else None,
                              lambda: export_session(session, x, out))
        if written is None:
            return []
        self.note("wrote " + ", ".join(map(str, written)))
        return written

    def _write(self, session: str, outputs: list[Path], replaces: Path | None, write):
        """`write()` once every output is checked (never the session) and, if `replaces`
        exists, the user agreed to replace it; what it returns (None: refused, declined or
        failed, and said so)."""
        try:
            for p in outputs:
                check_output(session, p)
        except ValueError as e:
            self.error(f"Export refused: {e}")
            return None
        if replaces is not None and replaces.exists() and not self.confirm_overwrite(replaces):
            return None
        QApplication.setOverrideCursor(Qt.WaitCursor)
        try:
            return write()
        except (ValueError, SessionError, OSError) as e:
            self.error(f"Export failed: {e}")
            return None
        finally:
            QApplication.restoreOverrideCursor()


def _folder(session: str) -> Path:
    return Path(session).parent if Path(session).parent.is_dir() else Path.home()
