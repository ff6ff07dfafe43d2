"""The main window: dockable panels around the block pool, a toolbar, a status bar."""

from __future__ import annotations

import importlib.resources
import os
import time
from pathlib import Path

import numpy as np
from PySide6.QtCore import QEvent, QSettings, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDockWidget,
    QFileDialog,
    QLabel,
    QMainWindow,
    QMessageBox,
    QProgressDialog,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from kvscope.app.banner import ErrorBanner
from kvscope.app.engine_client import EngineClient
from kvscope.app.engine_host import EngineInfo, Frame, RequestRow
from kvscope.app.panels.capacity_panel import CapacityPanel
from kvscope.app.panels.composer import Composer
from kvscope.app.panels.details import DetailsPanel
from kvscope.app.panels.device_panel import DevicePanel
from kvscope.app.panels.events_panel import EventsPanel
from kvscope.app.panels.pool_view import PoolView
from kvscope.app.panels.prefix_tree_panel import PrefixTreePanel
from kvscope.app.panels.requests_panel import RequestsPanel
from kvscope.app.panels.timeline import Timeline
from kvscope.app.replay_bar import ReplayBar
from kvscope.app.selection import Selection
from kvscope.engine.config import EngineConfig

FRAME_MS = 33  # the GUI pulls at most ~30 frames a second
TREE_HZ = 4  # the prefix tree is rebuilt at most this often
HINT = "Press Run demo (F5) or type a prompt"
DEMO_WORKLOAD = "shared_system_prompt.jsonl"


def workloads_dir() -> Path:
    return Path(os.fspath(importlib.resources.files("kvscope.resources") / "workloads"))


class MainWindow(QMainWindow):
    # Sent to the engine process.
    load_requested = Signal(str, object)
    submit_requested = Signal(object, object, object)
    workload_requested = Signal(object)
    resume_requested = Signal()
    pause_requested = Signal()
    step_requested = Signal()
    cancel_requested = Signal(int)
    record_requested = Signal(str, bool)
    stop_record_requested = Signal()

    def __init__(self, settings: QSettings | None = None, engine_setup: str | None = None):
        """engine_setup: a Python file each engine process runs first (see engine_host.main)."""
        super().__init__()
        self.setWindowTitle("kvscope")
        self.settings = settings or QSettings("kvscope", "kvscope")
        self.selection = Selection()
        self.snapshot = None
        self.model_name = "demo"
        self.running = False
        self.reader = None  # a SessionReader while replaying
        self._tree_due = 0.0
        self.recording_path: str | None = None
        self.last_session: str | None = None  # the latest recording, for export
        self._token_window: list[tuple[float, int]] = []
        self._build_panels()
        self._build_toolbar()
        self._build_worker(engine_setup)
        self._wire_selection()
        self.status = QLabel(HINT)
        self.statusBar().addWidget(self.status, 1)
        self.frame_timer = QTimer(self)
        self.frame_timer.timeout.connect(self.pull_frame)
        self.frame_timer.start(FRAME_MS)
        self._restore_layout()

    # --------------------------------------------------------------- layout
    def _build_panels(self) -> None:
        self.banner = ErrorBanner()
        self.pool = PoolView()
        self.replay_bar = ReplayBar()
        self.replay_bar.hide()
        self.replay_bar.step_changed.connect(self.show_replay_step)
        self.replay_bar.leave_requested.connect(self.leave_replay)
        central = QWidget()
        layout = QVBoxLayout(central)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.banner)
        layout.addWidget(self.replay_bar)
        layout.addWidget(self.pool, 1)
        self.setCentralWidget(central)
        self.requests = RequestsPanel()
        self.composer = Composer()
        self.details = DetailsPanel()
        self.timeline = Timeline()
        self.events = EventsPanel()
        self.tree = PrefixTreePanel()
        self.capacity = CapacityPanel()
        self.device = DevicePanel()
        self.docks = {}
        for name, title, widget, area in [
            ("requests", "Requests", self.requests, Qt.LeftDockWidgetArea),
            ("composer", "Prompt", self.composer, Qt.LeftDockWidgetArea),
            ("tree", "Prefix tree", self.tree, Qt.RightDockWidgetArea),
            ("details", "Details / Why it missed", self.details, Qt.RightDockWidgetArea),
            ("capacity", "Capacity", self.capacity, Qt.RightDockWidgetArea),
            ("device", "Device", self.device, Qt.RightDockWidgetArea),
            ("timeline", "Timeline", self.timeline, Qt.BottomDockWidgetArea),
            ("events", "Events", self.events, Qt.BottomDockWidgetArea),
        ]:
            dock = QDockWidget(title, self)
            dock.setObjectName(f"dock_{name}")
            dock.setWidget(widget)
            self.addDockWidget(area, dock)
            self.docks[name] = dock
        self.tabifyDockWidget(self.docks["timeline"], self.docks["events"])
        self.tabifyDockWidget(self.docks["tree"], self.docks["capacity"])
        self.tabifyDockWidget(self.docks["capacity"], self.docks["device"])
        self.docks["timeline"].raise_()
        self.docks["tree"].raise_()

    def _build_toolbar(self) -> None:
        tb = self.addToolBar("Main")
        tb.setObjectName("toolbar_main")
        self.model_box = QComboBox()
        self.model_box.setEditable(True)
        self.model_box.addItem("demo")
        self.model_box.addItem("SmolLM2-135M-Instruct (real)", "smollm2")
        self.model_box.setToolTip("demo, SmolLM2, a local model folder, a .gguf file, or a repo "
                                  "id in the local Hugging Face cache; Enter loads it")
        self.model_box.lineEdit().returnPressed.connect(self.reload)
        tb.addWidget(QLabel(" Model "))
        tb.addWidget(self.model_box)
        self.act_open_model = self._action("Open model…", "Ctrl+L", self.open_model_folder)
        tb.addAction(self.act_open_model)
        tb.addSeparator()
        self.act_demo = self._action("Run demo ▶", "F5", self.run_or_resume)
        self.act_workload = self._action("Run workload…", "Ctrl+W", self.open_workload)
        self.act_pause = self._action("Pause ❚❚", "Space", self.pause)
        self.act_step = self._action("Step ›", "N", self.step_once)
        self.act_step.setShortcuts([QKeySequence("N"), QKeySequence(Qt.Key_Right)])
        self.act_step.setToolTip("Step (N or →); in replay, the next recorded step")
        self.act_filter = self._action("Filter events", "Ctrl+F", self.focus_event_filter)
        self.act_back = self._action("Step back", "Left", lambda: self.replay_step_by(-1))
        self.act_record = self._action("Record ●", "Ctrl+R", self.toggle_recording)
        self.act_record.setCheckable(True)
        self.act_open_session = self._action("Open session…", "Ctrl+O", self.open_session_dialog)
        self.act_export = self._action("Export…", "Ctrl+E", self.export_dialog)
        for a in (self.act_demo, self.act_workload, self.act_pause, self.act_step,
                  self.act_record, self.act_open_session, self.act_export):
            tb.addAction(a)
        self.addAction(self.act_filter)
        tb.addSeparator()
        self.prefix_box = QCheckBox("prefix cache")
        self.prefix_box.setChecked(True)
        self.kv_box = QComboBox()
        self.kv_box.addItems(["auto", "float16", "bfloat16", "float32", "fp8"])
        self.blocks_box = QSpinBox(minimum=4, maximum=1 << 20, value=512)
        self.block_size_box = QSpinBox(minimum=1, maximum=256, value=16)
        self.blocks_box.setToolTip("Physical blocks in the KV pool")
        self.block_size_box.setToolTip("Tokens per block")
        tb.addWidget(self.prefix_box)
        tb.addWidget(QLabel(" kv "))
        tb.addWidget(self.kv_box)
        tb.addWidget(QLabel(" blocks "))
        tb.addWidget(self.blocks_box)
        tb.addWidget(QLabel(" × "))
        tb.addWidget(self.block_size_box)
        self.act_apply = self._action("Apply (reload)", "Ctrl+Shift+R", self.reload)
        tb.addAction(self.act_apply)

    def _action(self, text: str, shortcut: str, slot) -> QAction:
        action = QAction(text, self)
        action.setShortcut(QKeySequence(shortcut))
        action.setToolTip(f"{text} ({shortcut})")
        action.triggered.connect(slot)
        self.addAction(action)
        return action

    @property
    def engine(self) -> EngineInfo | None:
        """The loaded engine, as far as the window knows it (it runs in its own process)."""
        return self.worker.info

    def _build_worker(self, engine_setup: str | None) -> None:
        self.worker = EngineClient(engine_setup, parent=self)
        self.load_requested.connect(self.worker.load)
        self.submit_requested.connect(self.worker.submit)
        self.workload_requested.connect(self.worker.run_workload)
        self.resume_requested.connect(self.worker.resume)
        self.pause_requested.connect(self.worker.pause)
        self.step_requested.connect(self.worker.step_once)
        self.cancel_requested.connect(self.worker.cancel)
        self.record_requested.connect(self.worker.start_recording)
        self.stop_record_requested.connect(self.worker.stop_recording)
        self.worker.recording_changed.connect(self._on_recording_changed)
        self.worker.model_loaded.connect(self._on_model_loaded)
        self.worker.load_failed.connect(self._on_load_failed)
        self.worker.engine_error.connect(self._on_engine_error)
        self.worker.running_changed.connect(self._on_running_changed)
        self.worker.engine_exited.connect(self._on_engine_exited)
        self.worker.rejected.connect(lambda why: self.banner.show_error(f"Not queued: {why}"))
        self.worker.rejected.connect(self.composer.on_rejected)
        self.worker.submitted.connect(self.composer.on_submitted)
        self.composer.submitted.connect(self.submit)
        self.requests.cancel_requested.connect(self.cancel_requested)
        self.requests.explain_requested.connect(self.explain)

    def _wire_selection(self) -> None:
        sel = self.selection
        self.requests.request_selected.connect(sel.select_request)
        self.pool.block_clicked.connect(sel.select_block)
        self.tree.block_clicked.connect(sel.select_block)
        self.timeline.step_clicked.connect(sel.select_step)
        self.events.event_selected.connect(self._on_event_selected)
        sel.request_changed.connect(self._on_request_selected)
        sel.block_changed.connect(self._on_block_selected)
        sel.step_changed.connect(self.timeline.set_cursor)

    def _restore_layout(self) -> None:
        geometry = self.settings.value("geometry")
        state = self.settings.value("window_state")
        if geometry is not None:
            self.restoreGeometry(geometry)
        else:
            self.resize(1400, 900)
        if state is None or not self.restoreState(state):
            self.resizeDocks([self.docks["requests"], self.docks["tree"]], [460, 380],
                             Qt.Horizontal)
            self.resizeDocks([self.docks["timeline"]], [330], Qt.Vertical)
            self.resizeDocks([self.docks["requests"], self.docks["composer"]], [420, 200],
                             Qt.Vertical)

    def closeEvent(self, event) -> None:  # noqa: N802 - Qt API
        self.settings.setValue("geometry", self.saveGeometry())
        self.settings.setValue("window_state", self.saveState())
        self.device.stop()
        self.worker.shutdown()  # each engine process finalises its recording first
        super().closeEvent(event)

    # ------------------------------------------------------------- actions
    def engine_config(self) -> EngineConfig:
        return EngineConfig(block_size=self.block_size_box.value(),
                            num_blocks=self.blocks_box.value(),
                            kv_cache_dtype=self.kv_box.currentText(),
                            enable_prefix_caching=self.prefix_box.isChecked())

    def load_model(self, name: str) -> None:
        self._loading_name = name
        self.banner.hide()
        self.progress = QProgressDialog(f"Loading {name}…", "Cancel", 0, 0, self)
        self.progress.setWindowTitle("kvscope")
        self.progress.setMinimumDuration(300)
        self.progress.canceled.connect(self._on_load_cancelled)
        self.status.setText(f"loading {name}…")
        self.load_requested.emit(name, self.engine_config())

    def reload(self) -> None:
        text = self.model_box.currentText().strip() or "demo"
        self.load_model(self.model_box.itemData(self.model_box.findText(text)) or text)

    def open_model_folder(self) -> None:
        """A GGUF file, or a Hugging Face folder by its config.json."""
        folder, _ = QFileDialog.getOpenFileName(
            self, "Open a model: a GGUF file or a Hugging Face folder's config.json", "",
            "Models (*.gguf config.json)")
        if Path(folder).name == "config.json":
            folder = str(Path(folder).parent)
        if folder:
            self.model_box.setEditText(folder)
            self.load_model(folder)

    def submit(self, prompt, params, salt) -> None:
        if self.engine is None:
            self.banner.show_error("No model is loaded yet.")
            return
        self.submit_requested.emit(prompt, params, salt)
        self.resume_requested.emit()

    def run_or_resume(self) -> None:
        """F5: start the demo workload the first time, resume afterwards; in replay, play."""
        if self.reader is not None:
            self.replay_bar.play_button.setChecked(True)
            return
        if self.engine is None:
            return
        if not self._demo_started:
            self.run_workload(workloads_dir() / DEMO_WORKLOAD)
        else:
            self.resume_requested.emit()

    _demo_started = False

    def open_workload(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Run a workload", str(workloads_dir()),
                                              "Workloads (*.jsonl);;All files (*)")
        if path:
            self.run_workload(Path(path))

    def run_workload(self, path: Path) -> None:
        from kvscope.engine.workload import WorkloadError, load_workload

        try:
            workload = load_workload(path)
        except (OSError, WorkloadError) as e:
            self.banner.show_error(f"Cannot run {path.name}: {e}")
            return
        self._demo_started = True
        self.status.setText(f"running {path.name} ({len(workload)} requests)")
        self.workload_requested.emit(workload)

    def pause(self) -> None:
        if self.reader is not None:
            self.replay_bar.play_button.setChecked(not self.replay_bar.play_button.isChecked())
            return
        self.pause_requested.emit()

    def step_once(self) -> None:
        if self.reader is not None:
            self.replay_step_by(1)
            return
        self.step_requested.emit()

    # -------------------------------------------------------------- sessions
    def toggle_recording(self) -> None:
        if self.recording_path is not None:
            self.stop_record_requested.emit()
            return
        self.act_record.setChecked(False)  # checked once the worker says it records
        if self.engine is None:
            self.banner.show_error("Load a model before recording.")
            return
        path, _ = QFileDialog.getSaveFileName(self, "Record the session to", "session.kvscope",
                                              "kvscope sessions (*.kvscope)")
        if path:
            text = QMessageBox.question(
                self, "Record text?", "Also store prompt and output text in the file?\n\n"
                "Without it the file holds token counts and block hashes only.",
                QMessageBox.Yes | QMessageBox.No, QMessageBox.No) == QMessageBox.Yes
            self.start_recording(path, text)

    def start_recording(self, path: str, record_text: bool = False) -> None:
        self.record_requested.emit(path, record_text)

    def _on_recording_changed(self, path, note: str) -> None:
        if path is None and self.recording_path is not None:
            self.last_session = self.recording_path
        self.recording_path = path
        self.act_record.setChecked(path is not None)
        self.act_record.setText("Stop recording ■" if path else "Record ●")
        self.statusBar().showMessage(note if path is None else f"{note} to {path}", 8000)

    def open_session_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a recorded session", "",
                                              "kvscope sessions (*.kvscope);;All files (*)")
        if path:
            self.open_session(path)

    def open_session(self, path: str) -> bool:
        from kvscope.sessions import SessionError, SessionReader

        try:
            reader = SessionReader(path)
            if reader.num_steps == 0:
                reader.close()
                raise SessionError(f"{path}: the session has no recorded steps")
            events = reader.events_between(reader.first_step, reader.last_step)
        except SessionError as e:
            self.banner.show_error(f"Cannot open the session: {e}")
            return False
        self.pause_requested.emit()
        if self.reader is not None:
            self.reader.close()
        self.reader = reader
        self.banner.hide()
        self.timeline.clear()
        self.timeline.add_records(reader.steps())
        self.events.clear()
        self.events.add_events(events)
        self.requests.set_rows([_recorded_row(r) for r in reader.requests()])
        self.replay_bar.set_session(reader.first_step, reader.last_step, events)
        self.replay_bar.show()
        self.show_replay_step(reader.first_step)
        return True

    def show_replay_step(self, step: int) -> None:
        if self.reader is None:
            return
        from kvscope.sessions import SessionError

        try:
            snap = self.reader.snapshot_at(step)
            evicted = [b for e in self.reader.events_at(step) if e.kind == "evicted"
                       for b in e.blocks]
        except SessionError as e:
            self.banner.show_error(f"Cannot show step {step}: {e}")
            return
        self.snapshot = snap
        self.pool.set_snapshot(snap, np.asarray(evicted, dtype=np.int64))
        self.tree.set_snapshot(snap)
        self.selection.select_step(step)
        self._refresh_selection()
        self.replay_bar.label.setText(f"step {step} / {self.reader.last_step}")
        self.status.setText(f"replay · {Path(self.reader.path).name} · "
                            f"{self.reader.meta.model_name} · step {step} · "
                            f"{snap.num_active_blocks}/{snap.num_blocks} used · "
                            f"{snap.num_cached_blocks} cached · hit {snap.token_hit_rate:.0%}")

    def replay_step_by(self, delta: int) -> None:
        if self.reader is not None:
            self.replay_bar.step_by(delta)

    def leave_replay(self) -> None:
        if self.reader is None:
            return
        self.reader.close()
        self.reader = None
        self.replay_bar.play_button.setChecked(False)
        self.replay_bar.hide()
        self.timeline.clear()
        self.events.clear()
        self.requests.set_rows([])
        self.snapshot = None
        self.status.setText(f"{self.model_name} · live · {HINT}")

    def export_dialog(self) -> None:
        path = str(self.reader.path) if self.reader is not None else self.last_session
        if path is None:
            self.banner.show_error("Nothing to export yet: record a session (Ctrl+R) or open "
                                   "one (Ctrl+O).")
            return
        out, kind = QFileDialog.getSaveFileName(
            self, "Export the session", str(Path(path).with_suffix(".json")),
            "Chrome trace for ui.perfetto.dev (*.json);;CSV files (a folder)")
        if out:
            self.export(path, out, csv=kind.startswith("CSV"))

    def export(self, session: str, out: str, csv: bool = False) -> list[str]:
        from kvscope.sessions import SessionError, SessionReader, export_chrome_trace, export_csv

        try:
            with SessionReader(session) as reader:
                written = ([str(p) for p in export_csv(reader, out)] if csv
                           else [str(export_chrome_trace(reader, out))])
        except (SessionError, OSError) as e:
            self.banner.show_error(f"Export failed: {e}")
            return []
        self.statusBar().showMessage("wrote " + ", ".join(written), 8000)
        return written

    def focus_event_filter(self) -> None:
        self.docks["events"].show()
        self.docks["events"].raise_()
        self.events.search.setFocus()

    def explain(self, rid: int) -> None:
        if self.engine is None:
            return
        try:
            why = self.engine.explain_miss(rid)
        except KeyError:
            self.details.show_text(f"Request #{rid}", "It has not been admitted yet: nothing "
                                   "was looked up in the cache.")
            return
        self.details.show_text(f"Why #{rid} missed", why.message)

    # ------------------------------------------------------------- worker
    def _on_model_loaded(self, engine: EngineInfo) -> None:
        self.progress.reset()
        self.model_name = self._loading_name
        self.snapshot = None
        self.capacity.set_model_config(engine.model_config, self.model_name, engine.cache_dtype)
        self._demo_started = False
        self.timeline.clear()
        self.events.clear()
        self.selection.select_request(None)
        self.selection.select_block(None)
        self.status.setText(f"{self.model_name} loaded · {HINT}")

    def _on_load_failed(self, message: str, detail: str) -> None:
        self.progress.reset()
        self.banner.show_error(f"Could not load the model: {message}", detail)
        self.status.setText(HINT if self.engine else "no model loaded")

    def _on_load_cancelled(self) -> None:
        self.worker.cancel_load()
        self.status.setText("loading cancelled" + (f" · {self.model_name} still loaded"
                                                   if self.engine is not None else ""))

    def _on_engine_error(self, message: str, detail: str) -> None:
        self.banner.show_error(f"The engine stopped on an error (paused; the window keeps "
                               f"running): {message}", detail)

    def _on_engine_exited(self, message: str) -> None:
        self.banner.show_error(message)
        self.status.setText("no model loaded")

    def _on_running_changed(self, running: bool) -> None:
        self.running = running

    # -------------------------------------------------------------- frames
    def pull_frame(self) -> None:
        if self.reader is not None:
            return  # replaying: the live engine is paused and its frames wait
        frame: Frame | None = self.worker.take_frame()
        if frame is None:
            self._update_tree()  # the engine stopped: the tree catches up with the last frame
            return
        t0 = time.monotonic()
        self._draw_frame(frame)
        # However costly a frame is to draw, painting included (the paint that followed the
        # previous frame: this one's is done by the event loop, just after), the window leaves
        # two thirds of its time to input, and as much CPU and memory bandwidth to the engine
        # process (on a small machine they share more than the cores).
        self._frame_end = time.monotonic()
        cost = self._frame_end - t0 + self._paint_s
        self._paint_s = 0.0
        self.frame_timer.setInterval(max(FRAME_MS, int(3000 * cost)))

    _paint_s = 0.0  # seconds spent painting the window right after the last frame
    _frame_end = 0.0

    def event(self, event) -> bool:
        if event.type() != QEvent.UpdateRequest:
            return super().event(event)
        t0 = time.monotonic()  # the window paints every widget that changed, views included
        handled = super().event(event)
        if t0 - self._frame_end < self._paint_s + FRAME_MS / 1000:  # a frame's, not a hover's
            self._paint_s += time.monotonic() - t0
        return handled

    def _draw_frame(self, frame: Frame) -> None:
        self.snapshot = frame.snapshot
        self.pool.set_snapshot(frame.snapshot, frame.evicted)
        self.requests.set_rows(frame.requests)
        self.composer.show_requests(frame.requests)
        self._tree_stale = True
        if not self.timeline.add_records(frame.records):  # the two costly panels take turns
            self._update_tree()
        self.events.add_events(frame.events)
        self._refresh_selection()
        self._update_status(frame)

    _tree_stale = False  # frames came since the tree's last rebuild began

    def _update_tree(self) -> None:
        """The slowest panel: rebuilt at most TREE_HZ times a second, one slice of the rebuild
        per frame (none pays for all of it), and once more after the last frame."""
        if self.tree.pending:
            self.tree.advance()
            return
        now = time.monotonic()
        if (self._tree_stale and now >= self._tree_due and self.snapshot is not None
                and not self.docks["tree"].visibleRegion().isEmpty()):
            self.tree.prepare(self.snapshot)
            self._tree_due, self._tree_stale = now + 1 / TREE_HZ, False

    def _update_status(self, frame: Frame) -> None:
        s = frame.snapshot
        for r in frame.records:
            self._token_window.append((r.start_s + r.wall_s, r.prefill_tokens + r.decode_tokens))
        if self._token_window:
            end = self._token_window[-1][0]
            self._token_window = [(t, n) for t, n in self._token_window if t > end - 2.0]
        tokens = sum(n for _, n in self._token_window)
        span = (self._token_window[-1][0] - self._token_window[0][0]) if len(
            self._token_window) > 1 else 0
        rate = f"{tokens / span:.0f} tok/s" if span > 0 else "– tok/s"
        device = self.engine.device if self.engine is not None else "?"
        if self.engine is not None and self.engine.num_steps == 0:
            self.status.setText(f"{self.model_name} · {device} · {s.num_blocks} blocks of "
                                f"{s.block_size} tokens · {HINT}")
            return
        self.status.setText(
            f"{self.model_name} · {device} · {s.num_active_blocks}/{s.num_blocks} used · "
            f"{s.num_cached_blocks} cached · {s.num_free_blocks} free · step {s.step} · "
            f"hit {s.token_hit_rate:.0%} · {rate}" + (" · running" if self.running else ""))

    # ----------------------------------------------------------- selection
    def _refresh_selection(self) -> None:
        rid = self.selection.request
        self.requests.show_block_table(self.snapshot, rid)
        blocks = None
        if self.snapshot is not None and rid in self.snapshot.block_tables:
            blocks = self.snapshot.block_tables[rid]
        elif self.selection.block is not None:
            blocks = [self.selection.block]
        self.pool.highlight(blocks)
        self.tree.highlight(blocks)

    def _on_request_selected(self, rid) -> None:
        self.requests.select(rid)
        self._refresh_selection()

    def _on_block_selected(self, block) -> None:
        if block is not None and self.snapshot is not None:
            self.details.show_text(f"Block {block}", self.pool.describe(block))
            owners = [r for r, t in self.snapshot.block_tables.items() if block in t]
            if owners:
                self.selection.select_request(min(owners))
                return
        self._refresh_selection()

    def _on_event_selected(self, event) -> None:
        self.selection.select_step(event.step)
        if event.request_id is not None:
            self.selection.select_request(event.request_id)
        if event.blocks:
            self.pool.highlight(np.asarray(event.blocks))


def _recorded_row(r) -> RequestRow:
    """A requests-table row from a recorded request (its state when the recording ended)."""
    state = f"finished: {r.finish_reason}" if r.status == "finished" else r.status
    return RequestRow(r.request_id, state, r.prompt_tokens, r.cached_tokens or 0,
                      r.output_tokens or 0, r.ttft_s, r.tpot_s, r.salt_digest, r.parent_id,
                      r.output_text or "")
