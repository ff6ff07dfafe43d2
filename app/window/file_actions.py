"""The File menu's work: open a model, a workload or a session (the dialogs), record the live
engine's session, export a session, and keep the experiments measured while recording in the
recording. The window keeps `recording_path` (None: not recording) and `last_session` (the
latest recording, for export); both are written here only."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtWidgets import QFileDialog, QMessageBox

from kvscope.app.window.engine_controls import workloads_dir
from kvscope.sessions import SessionError


class FileActions:
    def __init__(self, window):
        self.w = window
        self._recorded_experiments = []  # measured while recording: saved when it stops

    # ------------------------------------------------------------------- open
    def open_model_folder(self) -> None:
        """A GGUF file, or a Hugging Face folder by its config.json."""
        folder, _ = QFileDialog.getOpenFileName(
            self.w, "Open a model: a GGUF file or a Hugging Face folder's config.json", "",
            "Models (*.gguf config.json)")
        if Path(folder).name == "config.json":
            folder = str(Path(folder).parent)
        if folder:
            self.w.load_model(folder)

    def open_workload(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self.w, "Run a workload", str(workloads_dir()),
                                              "Workloads (*.jsonl);;All files (*)")
        if path:
            self.w.engine_controls.run_workload(Path(path))

    def open_session_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self.w, "Open a recorded session", "",
                                              "kvscope sessions (*.kvscope);;All files (*)")
        if path:
            self.w.open_session(path)

    # -------------------------------------------------------------- recording
    def toggle_recording(self) -> None:
        w = self.w
        if w.recording_path is not None:
            w.engine_client.stop_recording()
            return
        w.act_record.setChecked(False)  # checked once the engine process says it records
        if w.source.attached:
            w.banner.show_error("An attached server is recorded from File → Attach… "
                                "(Record to), or with kvscope attach --record FILE.")
            return
        if w.engine is None:
            w.banner.show_error("Load a model before recording.")
            return
        path, _ = QFileDialog.getSaveFileName(w, "Record the session to", "session.kvscope",
                                              "kvscope sessions (*.kvscope)")
        if path:
            text = QMessageBox.question(
                w, "Record text?", "Also store prompt and output text in the file?\n\n"
                "Without it the file holds token counts and block hashes only.",
                QMessageBox.Yes | QMessageBox.No, QMessageBox.No) == QMessageBox.Yes
            self.start_recording(path, text)

    def start_recording(self, path: str, record_text: bool = False) -> None:
        """Without text, the engine saves the session it keeps since the model loaded, when the
        recording stops; with text, it records from now on (the history has no text)."""
        self.w.engine_client.start_recording(path, record_text)

    def on_recording_changed(self, path, note: str) -> None:
        w = self.w
        if path is None and w.recording_path is not None:
            w.last_session = w.recording_path
            self._save_recorded_experiments(w.last_session)
        w.recording_path = path
        w.act_record.setChecked(path is not None)
        w.act_record.setText("Stop recording ■" if path else "Record ●")
        w.recording_label.setText(f"● recording {Path(path).name}" if path else "")
        w.statusBar().showMessage(note if path is None else f"{note} to {path}", 8000)

    def save_experiment(self, result) -> None:
        """A result measured while recording is kept in the recording, written when the
        recording stops (the engine process may write the file only then)."""
        if self.w.recording_path is not None:
            self._recorded_experiments.append(result)

    def _save_recorded_experiments(self, path: str) -> None:
        from kvscope.sessions.experiments import save_experiment

        results, self._recorded_experiments = self._recorded_experiments, []
        try:
            for result in results:
                save_experiment(path, result)
        except SessionError as e:
            self.w.banner.show_error(f"Cannot save the experiments in the recording: {e}")

    # ----------------------------------------------------------------- export
    def export_dialog(self) -> list:
        """File → Export…: the replayed session, or the last one recorded, by any exporter."""
        w = self.w
        return w.range_export.export_session(str(w.reader.path) if w.reader is not None
                                             else w.last_session)
