"""The live engine, run from the window: load a model, run the demo or a workload, pause, step,
submit; and what its engine process says (loaded, failed, errors, running, exited) shown in the
window. The window keeps `model_name` (the model loaded) and `running`; both are written here
only."""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path

from PySide6.QtWidgets import QProgressDialog

from kvscope.app.frames import EngineInfo
from kvscope.app.host.client import NOT_RESPONDING
from kvscope.app.window.status_line import HINT
from kvscope.engine.config import EngineConfig

LOAD_DIALOG_MS = 300  # a load still running after this shows a dialog that can cancel it
DEMO_WORKLOAD = "demo.jsonl"  # sized for the default pool: fills it, then evicts
DEMO_WORKLOADS = {"demo-hybrid": "long_context.jsonl"}  # F5's, on models that have their own
DEMO_PACE = 8  # steps per second while running: slow enough to watch blocks come and go


def workloads_dir() -> Path:
    return Path(os.fspath(importlib.resources.files("kvscope.resources") / "workloads"))


class EngineControls:
    def __init__(self, window):
        self.w = window
        self.idle = True  # nothing left to run (the engine said so, or nothing ran): F5 plays
        #                   the demo, else it resumes
        self.loading_name = ""

    def connect(self) -> None:
        """The engine process's signals (`window.engine_client`)."""
        w = self.w
        c = w.engine_client
        c.recording_changed.connect(w.files.on_recording_changed)
        c.model_loaded.connect(self._on_model_loaded)
        c.load_failed.connect(self._on_load_failed)
        c.engine_error.connect(lambda message, detail: w.banner.show_error(
            f"The engine stopped on an error (paused; the window keeps running): {message}",
            detail))
        c.running_changed.connect(self._on_running_changed)
        c.idle.connect(self._on_idle)
        c.engine_exited.connect(self._on_engine_exited)
        c.request_failed.connect(lambda message, detail: w.banner.show_error(
            f"A request failed (the others run on): {message}", detail))
        c.not_responding.connect(self._on_not_responding)
        c.rejected.connect(lambda why: w.banner.show_error(f"Not queued: {why}"))
        c.rejected.connect(w.composer.on_rejected)
        c.submitted.connect(w.composer.on_submitted)

    def engine_config(self) -> EngineConfig:
        w = self.w
        return EngineConfig(block_size=w.block_size_box.value(), num_blocks=w.blocks_box.value(),
                            kv_cache_dtype=w.kv_box.currentText(),
                            enable_prefix_caching=w.prefix_box.isChecked(),
                            host_blocks=w.host_blocks_box.value())

    # ------------------------------------------------------------------ load
    def load_model(self, name: str) -> None:
        w = self.w
        self.loading_name = name
        w.model_box.show_model(name)
        w.banner.hide()
        w.progress = QProgressDialog(f"Loading {name}…", "Cancel", 0, 0, w)
        w.progress.setWindowTitle("kvscope")
        w.progress.setMinimumDuration(LOAD_DIALOG_MS)
        w.progress.setValue(0)  # starts the dialog's clock: without it, it waits 4 s
        w.progress.canceled.connect(self._on_load_cancelled)
        w.status.setText(f"loading {name}…")
        w.engine_client.load(name, self.engine_config())

    def reload(self) -> None:
        box = self.w.model_box
        text = box.currentText().strip() or "demo"
        self.load_model(box.itemData(box.findText(text)) or text)

    def pick(self, name: str) -> None:
        """A model picked in the Model list loads at once (the one loaded stays as it is)."""
        w = self.w
        if w.engine is None or name != w.model_name or w.engine_client.loading:
            self.load_model(name)

    def _on_model_loaded(self, engine: EngineInfo) -> None:
        w = self.w
        self._close_progress()
        w.model_name = self.loading_name
        w.capacity.set_model_config(engine.model_config, w.model_name,
                                    engine.kv_format or engine.cache_dtype, engine.block_size)
        w.experiments.model = w.model_name
        w.composer.set_model(engine.model_name, engine.chat_template)
        self.idle = True
        w.engine_client.pace(w.pace_box.value())  # a new engine process: tell it the pace
        w.live.reset()
        if w.source is w.live:  # not an attached server
            w.open_source(w.live)
        w.status.setText(f"{w.model_name} loaded · {HINT}")

    def _close_progress(self) -> None:
        """The load dialog goes; the window gets the keyboard back (F5 right away)."""
        shown = self.w.progress.isVisible()
        self.w.progress.reset()
        if shown:
            self.w.activateWindow()

    def _on_load_failed(self, message: str, detail: str) -> None:
        self._close_progress()
        self.w.banner.show_error(f"Could not load the model: {message}", detail)
        self._back_to_loaded("not loaded")

    def _on_load_cancelled(self) -> None:
        self.w.engine_client.cancel_load()
        self._back_to_loaded("loading cancelled")

    def _back_to_loaded(self, what: str) -> None:
        """A load that failed or was cancelled: the model box and the status bar name the model
        still loaded, if any."""
        w = self.w
        if w.engine is None:
            w.status.setText(f"{what} · no model loaded")
            return
        w.model_box.show_model(w.model_name)
        w.status.setText(f"{what}: {self.loading_name} · {w.model_name} still loaded · {HINT}")

    # ------------------------------------------------------------------- run
    def submit(self, prompt, params, salt) -> None:
        if self.w.engine is None:
            self.w.banner.show_error("No model is loaded yet.")
            return
        self.w.engine_client.submit(prompt, params, salt, run=True)

    def run_or_resume(self) -> None:
        """F5: resume what is paused half-way, else play the demo workload (again)."""
        w = self.w
        if w.engine is None:
            w.banner.show_error("No model is loaded: load one with Apply (reload), Enter in "
                                "the model box, or Open model folder (Ctrl+L).")
            return
        if self.idle:
            name = DEMO_WORKLOADS.get(w.model_name, DEMO_WORKLOAD)
            self.run_workload(workloads_dir() / name)
        else:
            w.engine_client.resume()

    def run_workload(self, path: Path) -> None:
        from kvscope.lab.workload import WorkloadError, load_workload

        try:
            workload = load_workload(path)
        except (OSError, WorkloadError) as e:
            self.w.banner.show_error(f"Cannot run {path.name}: {e}")
            return
        self.idle = False
        self.w.status.setText(f"running {path.name} ({len(workload)} requests)")
        self.w.engine_client.run_workload(workload)

    def pause(self) -> None:
        self.w.engine_client.pause()

    def step_once(self) -> None:
        """N or →: the engine runs one step; looking at a past step, the next step is shown."""
        w = self.w
        if w.selection.step is None:
            w.engine_client.step_once()
        else:
            w.frame_pump.move_cursor(1)

    # ------------------------------------------------------- engine process
    def _on_not_responding(self, silent: bool) -> None:
        banner = self.w.banner
        if silent:
            banner.show_error(NOT_RESPONDING)
        elif banner.label.text() == NOT_RESPONDING:
            banner.hide()

    def _on_engine_exited(self, message: str) -> None:
        self.w.banner.show_error(message)
        self.w.status.setText("no model loaded")

    def _on_running_changed(self, running: bool) -> None:
        self.w.running = running  # the status bar says running or paused at once
        self.idle = self.idle and not running
        self.w.frame_pump.show_status()

    def _on_idle(self) -> None:
        self.idle = True  # F5 plays the demo again
        self.w.frame_pump.show_status()

    def run_state(self) -> str:
        """What the engine is doing, and what F5 does, for the status bar ("": nothing ran)."""
        engine = self.w.engine
        if self.w.running:
            return "running"
        if engine is None or (engine.num_steps == 0 and self.idle):
            return ""  # (paused before the first step came back: "paused", below)
        return "nothing left to run · F5 runs the demo" if self.idle else "paused · F5 resumes"
