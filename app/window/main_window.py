"""The main window: dockable panels around the block pool, a toolbar, a status bar."""

from __future__ import annotations

import importlib.resources
import os
import time
from pathlib import Path

from PySide6.QtCore import QEvent, QSettings, Qt, QTimer
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
    QTabBar,
    QVBoxLayout,
    QWidget,
)

from kvscope.app import palette
from kvscope.app.frames import EngineInfo, Frame, RequestText, recorded_text
from kvscope.app.host.client import NOT_RESPONDING, EngineClient
from kvscope.app.panels.capacity_panel import CapacityPanel
from kvscope.app.panels.composer import Composer
from kvscope.app.panels.details import DetailsPanel
from kvscope.app.panels.device_panel import DevicePanel
from kvscope.app.panels.events_panel import EventsPanel
from kvscope.app.panels.experiments_panel import ExperimentsPanel
from kvscope.app.panels.lab_panel import LabPanel
from kvscope.app.panels.pool_view import PoolView
from kvscope.app.panels.prefix_tree_panel import PrefixTreePanel
from kvscope.app.panels.requests_panel import RequestsPanel
from kvscope.app.panels.text_panel import TextPanel
from kvscope.app.panels.timeline import Timeline
from kvscope.app.selection import Selection
from kvscope.app.sources.base import FrameSource
from kvscope.app.sources.live import LiveSource
from kvscope.app.sources.replay import ReplaySource
from kvscope.app.window.attach_view import AttachDialog, AttachOverlay
from kvscope.app.window.banner import ErrorBanner
from kvscope.app.window.range_export import RangeExporter
from kvscope.app.window.replay_bar import ReplayBar
from kvscope.app.window.status_line import HINT, StatusLine
from kvscope.engine.config import DEFAULT_CPU_BLOCKS, EngineConfig
from kvscope.sessions import SessionError

FRAME_MS = 33  # the GUI pulls at most ~30 frames a second
TREE_HZ = 4  # the prefix tree is rebuilt at most this often
TREE_MAX_SKIPS = 8  # frames in a row the tree yields to the timeline before it runs anyway
LOAD_DIALOG_MS = 300  # a load still running after this shows a dialog that can cancel it
DEMO_WORKLOAD = "demo.jsonl"  # sized for the default pool: fills it, then evicts
DEMO_PACE = 8  # steps per second while running: slow enough to watch blocks come and go


# The smallest size each dock's panel is readable at (a restored layout never goes below it).
MIN_SIZES = {"requests": (260, 180), "composer": (200, 120), "tree": (200, 150),
             "details": (200, 80), "capacity": (200, 150), "device": (200, 120),
             "timeline": (300, 170), "events": (300, 100), "text": (200, 100)}


ON_DEMAND = ("lab", "experiments")  # tools of their own, shown from the View menu (the lab
#                                    also with Ctrl+Shift+L), tabbed with Device


def _dock_layout(w) -> list:
    return [
        ("requests", "Requests", w.requests, Qt.LeftDockWidgetArea),
        ("composer", "Prompt", w.composer, Qt.LeftDockWidgetArea),
        ("tree", "Prefix tree", w.tree, Qt.RightDockWidgetArea),
        ("details", "Details / Why it missed", w.details, Qt.RightDockWidgetArea),
        ("capacity", "Capacity", w.capacity, Qt.RightDockWidgetArea),
        ("device", "Device", w.device, Qt.RightDockWidgetArea),
        ("lab", "Cache lab", w.lab, Qt.RightDockWidgetArea),
        ("experiments", "Experiments", w.experiments, Qt.RightDockWidgetArea),
        ("timeline", "Timeline", w.timeline, Qt.BottomDockWidgetArea),
        ("events", "Events", w.events, Qt.BottomDockWidgetArea),
        ("text", "Text", w.text, Qt.RightDockWidgetArea),
    ]


def workloads_dir() -> Path:
    return Path(os.fspath(importlib.resources.files("kvscope.resources") / "workloads"))


class MainWindow(QMainWindow):
    def __init__(self, settings: QSettings | None = None, engine_setup: str | None = None):
        """engine_setup: a Python file each engine process runs first (see engine_host.main)."""
        super().__init__()
        self.setWindowTitle("kvscope")
        self.settings = settings or QSettings("kvscope", "kvscope")
        self.selection = Selection()  # the step shown (None: the newest), request, blocks
        self.snapshot = None  # the snapshot shown
        self.model_name = "demo"
        self.running = False
        self._tree_due = 0.0
        self._tree_skips = 0  # frames the tree gave to the timeline since it last caught up
        self.recording_path: str | None = None
        self.last_session: str | None = None  # the latest recording, for export
        self._recorded_experiments = []  # measured while recording: saved when it stops
        self.worker = EngineClient(engine_setup, parent=self)
        self.live = LiveSource(self.worker)
        self.source: FrameSource = self.live
        self._build_panels()
        self._build_toolbar()
        self._build_menus()
        self._connect_worker()
        self.selection.step_changed.connect(self._on_cursor)
        self.status = StatusLine()
        self.statusBar().addWidget(self.status, 1)
        self.recording_label = QLabel()  # says "● recording <file>" while recording
        self.recording_label.setStyleSheet(f"color: {palette.EVICTED_COLOR}")
        self.statusBar().addPermanentWidget(self.recording_label)
        self.attach_view = AttachOverlay(self)  # only while an attached server is shown
        self.centralWidget().layout().insertWidget(2, self.attach_view.note)
        self.statusBar().addPermanentWidget(self.attach_view.health)
        self.frame_timer = QTimer(self)
        self.frame_timer.timeout.connect(self.pull_frame)
        self.frame_timer.start(FRAME_MS)
        self._restore_layout()

    # --------------------------------------------------------------- layout
    def _build_panels(self) -> None:
        self.banner = ErrorBanner()
        sel = self.selection
        self.pool = PoolView(sel)
        self.replay_bar = ReplayBar(sel)
        self.replay_bar.hide()
        self.replay_bar.leave_requested.connect(self.leave_replay)
        central = QWidget()
        layout = QVBoxLayout(central)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.banner)
        layout.addWidget(self.replay_bar)
        layout.addWidget(self.pool, 1)
        self.setCentralWidget(central)
        self.requests = RequestsPanel(sel)
        self.composer = Composer()
        self.details = DetailsPanel(sel)
        self.timeline = Timeline(sel)
        self.range_export = RangeExporter(self, self.shown_session, self.banner.show_error,
                                          lambda text: self.statusBar().showMessage(text, 8000))
        self.timeline.export_range_requested.connect(self.range_export.export)
        self.events = EventsPanel(sel)
        self.tree = PrefixTreePanel(sel)
        self.text = TextPanel(sel)
        sel.request_changed.connect(self._watch_request)
        self.panels = [self.pool, self.requests, self.details, self.timeline, self.events,
                       self.tree, self.text]  # each shows every frame: show_frame(frame), clear()
        self.capacity = CapacityPanel()
        self.device = DevicePanel()
        self.lab = LabPanel()
        self.lab.open_requested.connect(self.open_lab_replay)
        self.experiments = ExperimentsPanel()
        self.experiments.finished.connect(self._save_experiment)
        self.docks = {}
        for name, title, widget, _area in _dock_layout(self):
            dock = QDockWidget(title, self)
            dock.setObjectName(f"dock_{name}")
            dock.setWidget(widget)
            self.docks[name] = dock
        for name, (w, h) in MIN_SIZES.items():  # a restored layout never squeezes them more
            self.docks[name].widget().setMinimumSize(w, h)
        self._place_docks()
        lab = self.docks["lab"].toggleViewAction()
        lab.setShortcut(QKeySequence("Ctrl+Shift+L"))
        self.addAction(lab)

    def _place_docks(self) -> None:
        """The default layout: requests left, tree and details right, timeline below."""
        for name, _title, _widget, area in _dock_layout(self):
            dock = self.docks[name]
            dock.setFloating(False)
            # hidden ones never stack up the window (Text is shown once it is in its tab group)
            dock.setVisible(name not in ON_DEMAND and name != "text")
            self.addDockWidget(area, dock)
        self.tabifyDockWidget(self.docks["timeline"], self.docks["events"])
        self.tabifyDockWidget(self.docks["details"], self.docks["text"])
        self.tabifyDockWidget(self.docks["tree"], self.docks["capacity"])
        self.tabifyDockWidget(self.docks["capacity"], self.docks["device"])
        self.tabifyDockWidget(self.docks["device"], self.docks["experiments"])
        self.tabifyDockWidget(self.docks["device"], self.docks["lab"])
        # Text is shown once every group is made: shown before, the window came up taller
        # than asked at 1280x720 and left a stale tab bar on screen
        self.docks["text"].show()
        self.docks["timeline"].raise_()
        self.docks["tree"].raise_()
        self.docks["details"].raise_()  # "How to read this window" first; Text beside it
        self._renew_tab_bars()

    def _renew_tab_bars(self) -> None:
        """Qt 6.11 leaves a stray copy of a dock tab bar on screen when a second group of
        docks is tabified (a "Prefix tree | Capacity" bar over the requests, cut to "P" when
        covered), deleted only once the event loop runs: the first paint or a screenshot
        taken before shows it. restoreState() builds the bars without strays: hide them all and
        restore the layout just made. Tab titles stay whole (scroll buttons, never "P…")."""
        for bar in self.findChildren(QTabBar, options=Qt.FindDirectChildrenOnly):
            bar.hide()
        self.restoreState(self.saveState())
        for bar in self.findChildren(QTabBar, options=Qt.FindDirectChildrenOnly):
            bar.setElideMode(Qt.ElideNone)
            bar.setUsesScrollButtons(True)

    def _default_sizes(self) -> None:
        """Dock sizes as shares of the window, so a small window gets a usable layout too."""
        w, h = self.width(), self.height()
        self.resizeDocks([self.docks["requests"], self.docks["tree"]],
                         [int(w * 0.33), int(w * 0.27)], Qt.Horizontal)
        self.resizeDocks([self.docks["timeline"]], [int(h * 0.3)], Qt.Vertical)
        # the right column's halves: the tree, and Details / Text (a prompt needs lines)
        self.resizeDocks([self.docks["tree"], self.docks["details"]], [h // 2, h // 2],
                         Qt.Vertical)
        self.resizeDocks([self.docks["requests"], self.docks["composer"]],
                         [int(h * 0.4), self._composer_height()], Qt.Vertical)

    def _composer_height(self) -> int:
        return max(MIN_SIZES["composer"][1], self.composer.needed_height())

    def _fit_composer(self) -> None:
        """Chat mode shows the transcript: grow the Prompt dock to show it and every field
        (taking the height from the requests above), never shrink it."""
        dock, above = self.docks["composer"], self.docks["requests"]
        have, need = dock.height(), dock.height() - dock.widget().height() + self._composer_height()
        if (dock.isVisible() and not dock.isFloating() and have < need
                and self.dockWidgetArea(above) == self.dockWidgetArea(dock)):
            self.resizeDocks([above, dock], [above.height() - (need - have), need], Qt.Vertical)

    def reset_layout(self) -> None:
        size = self.size()  # re-adding the docks stacks them for a moment: the window would grow
        self._place_docks()
        self.resize(size)
        self._default_sizes()

    def _build_menus(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        for a in (self.act_open_model, self.act_workload, self.act_open_session,
                  self.act_record, self.act_export):
            file_menu.addAction(a)
        file_menu.addSeparator()
        self.act_attach = file_menu.addAction("Attach…", self.attach_dialog)
        self.act_attach.setShortcut(QKeySequence("Ctrl+Shift+A"))
        self.act_attach.setToolTip("Show a vLLM/SGLang server's KV cache from its KV events")
        self.act_detach = file_menu.addAction("Detach", lambda: self.set_source(self.live))
        self.act_detach.setEnabled(False)
        self.view_menu = self.menuBar().addMenu("&View")
        for dock in self.docks.values():
            self.view_menu.addAction(dock.toggleViewAction())
        self.view_menu.addSeparator()
        self.view_menu.addAction(self.timeline.act_wall_clock)
        self.act_reset_layout = self.view_menu.addAction("Reset layout", self.reset_layout)

    def _build_toolbar(self) -> None:
        tb = self.addToolBar("Main")
        tb.setObjectName("toolbar_main")
        self.model_box = QComboBox()
        self.model_box.setEditable(True)
        self.model_box.addItem("demo")
        self.model_box.addItem("SmolLM2-135M-Instruct (real)", "smollm2")
        # As wide as a short name, not the longest entry: the toolbar must fit 1280 px.
        self.model_box.setMaximumWidth(self.model_box.fontMetrics().horizontalAdvance("demo") + 40)
        self.model_box.view().setMinimumWidth(self.model_box.view().sizeHintForColumn(0) + 24)
        self.model_box.setToolTip("demo, SmolLM2, a local model folder, a .gguf file, or a repo "
                                  "id in the local Hugging Face cache; Enter loads it")
        self.model_box.lineEdit().returnPressed.connect(self.reload)
        # A long name shows its start ("SmolLM2-13…"), not its end ("…ct (real)").
        self.model_box.currentIndexChanged.connect(
            lambda _i: self.model_box.lineEdit().setCursorPosition(0))
        tb.addWidget(QLabel(" Model "))
        tb.addWidget(self.model_box)
        self.act_open_model = self._action("Open model…", "Ctrl+L", self.open_model_folder)
        tb.addSeparator()
        self.act_demo = self._action("Run demo ▶", "F5", self.run_or_resume)
        self.act_workload = self._action("Run workload…", "Ctrl+W", self.open_workload)
        self.act_pause = self._action("Pause ❚❚", "Space", self.pause)
        self.act_step = self._action("Step ›", "N", self.step_once)
        self.act_step.setShortcuts([QKeySequence("N"), QKeySequence(Qt.Key_Right)])
        self.act_step.setToolTip("Step (N or →); in replay, the next recorded step")
        self.act_filter = self._action("Filter events", "Ctrl+F", self.focus_event_filter)
        self.act_back = self._action("Step back", "Left", lambda: self.move_cursor(-1))
        self.act_back.setToolTip("The previous step (←): live, this looks back in the history")
        self.act_first = self._action("First step", "Home", self.first_step)
        self.act_first.setToolTip("The first step kept (Home), live or in replay")
        self.act_follow = self._action("Follow live", "End", self.follow)
        self.act_follow.setToolTip("Show the newest step again (End); in replay, the last step")
        self.act_follow.setEnabled(False)
        self.act_record = self._action("Record ●", "Ctrl+R", self.toggle_recording)
        self.act_record.setCheckable(True)
        self.act_open_session = self._action("Open session…", "Ctrl+O", self.open_session_dialog)
        self.act_export = self._action("Export…", "Ctrl+E", self.export_dialog)
        for a in (self.act_demo, self.act_pause, self.act_step):
            tb.addAction(a)
        self.pace_box = QSpinBox(minimum=0, maximum=1000, value=DEMO_PACE, suffix=" steps/s")
        self.pace_box.setSpecialValueText("max speed")
        self.pace_box.setToolTip("How many steps a second the engine runs (0: as fast as it "
                                 "can); slow enough to watch by default")
        self.pace_box.valueChanged.connect(self.worker.pace)
        tb.addWidget(self.pace_box)
        for a in (self.act_follow, self.act_record, self.act_open_session):
            tb.addAction(a)
        # "Stop recording ■" is wider than "Record ●": the button keeps the wider width, so
        # the toolbar never shifts when recording starts or stops.
        record = tb.widgetForAction(self.act_record)
        record.setFixedWidth(record.fontMetrics().horizontalAdvance("Stop recording ■") + 16)
        self.addAction(self.act_filter)
        tb.addSeparator()
        self.prefix_box = QCheckBox("prefix cache")
        self.prefix_box.setChecked(True)
        self.kv_box = QComboBox()
        self.kv_box.addItems(["auto", "float16", "bfloat16", "float32", "fp8"])
        self.blocks_box = QSpinBox(minimum=4, maximum=1 << 20, value=DEFAULT_CPU_BLOCKS)
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
        self.policy_label = QLabel()  # a replayed session's eviction policy, when recorded
        self.policy_label.setToolTip("The session's eviction policy")
        self.policy_shown = tb.addWidget(self.policy_label)
        self.policy_shown.setVisible(False)
        self.settings_widgets = (self.model_box, self.act_open_model, self.prefix_box,
                                 self.kv_box, self.blocks_box, self.block_size_box,
                                 self.act_apply)
        self._tips = {w: w.toolTip() for w in self.settings_widgets}
        self._live_settings: tuple | None = None  # the user's, kept while replaying

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

    def _connect_worker(self) -> None:
        w = self.worker
        w.recording_changed.connect(self._on_recording_changed)
        w.model_loaded.connect(self._on_model_loaded)
        w.load_failed.connect(self._on_load_failed)
        w.engine_error.connect(self._on_engine_error)
        w.running_changed.connect(self._on_running_changed)
        w.engine_exited.connect(self._on_engine_exited)
        w.request_failed.connect(lambda message, detail: self.banner.show_error(
            f"A request failed (the others run on): {message}", detail))
        w.not_responding.connect(self._on_not_responding)
        w.rejected.connect(lambda why: self.banner.show_error(f"Not queued: {why}"))
        w.rejected.connect(self.composer.on_rejected)
        w.submitted.connect(self.composer.on_submitted)
        self.composer.submitted.connect(self.submit)
        self.composer.chat.toggled.connect(lambda _on: QTimer.singleShot(0, self._fit_composer))
        self.requests.cancel_requested.connect(w.cancel)
        self.requests.explain_requested.connect(self.explain)

    def _restore_layout(self) -> None:
        geometry = self.settings.value("geometry")
        state = self.settings.value("window_state")
        if geometry is not None:
            self.restoreGeometry(geometry)
        else:
            self.resize(1400, 900)
        if state is None or not self.restoreState(state):
            self._default_sizes()
        self._renew_tab_bars()

    def closeEvent(self, event) -> None:  # noqa: N802 - Qt API
        self.settings.setValue("geometry", self.saveGeometry())
        self.settings.setValue("window_state", self.saveState())
        self.device.stop()
        self.source.close()
        self.live.close()
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
        self.progress.setMinimumDuration(LOAD_DIALOG_MS)
        self.progress.setValue(0)  # starts the dialog's clock: without it, it waits 4 s
        self.progress.canceled.connect(self._on_load_cancelled)
        self.status.setText(f"loading {name}…")
        self.worker.load(name, self.engine_config())

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
        self.worker.submit(prompt, params, salt, run=True)

    def run_or_resume(self) -> None:
        """F5: start the demo workload the first time, resume afterwards; in replay, play."""
        if not self.source.live:
            self.replay_bar.play_button.setChecked(True)
            return
        if self.engine is None:
            self.banner.show_error("No model is loaded: load one with Apply (reload), Enter in "
                                   "the model box, or Open model folder (Ctrl+L).")
            return
        if not self._demo_started:
            self.run_workload(workloads_dir() / DEMO_WORKLOAD)
        else:
            self.worker.resume()

    _demo_started = False

    def open_workload(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Run a workload", str(workloads_dir()),
                                              "Workloads (*.jsonl);;All files (*)")
        if path:
            self.run_workload(Path(path))

    def run_workload(self, path: Path) -> None:
        from kvscope.lab.workload import WorkloadError, load_workload

        try:
            workload = load_workload(path)
        except (OSError, WorkloadError) as e:
            self.banner.show_error(f"Cannot run {path.name}: {e}")
            return
        self._demo_started = True
        self.status.setText(f"running {path.name} ({len(workload)} requests)")
        self.worker.run_workload(workload)

    def pause(self) -> None:
        if not self.source.live:
            self.replay_bar.play_button.setChecked(not self.replay_bar.play_button.isChecked())
            return
        self.worker.pause()

    def step_once(self) -> None:
        """N or →: the engine runs one step; looking at a past step, the next step is shown."""
        if self.source.live and self.selection.step is None:
            self.worker.step_once()
        else:
            self.move_cursor(1)

    # ---------------------------------------------------------- time cursor
    def move_cursor(self, delta: int) -> None:
        steps = self.source.step_range()
        if steps is None:
            return
        now = self.selection.step if self.selection.step is not None else steps[1]
        self.selection.select_step(max(steps[0], min(steps[1], now + delta)))

    def first_step(self) -> None:
        steps = self.source.step_range()
        if steps is not None:
            self.selection.select_step(steps[0])

    def follow(self) -> None:
        """End: back to the newest step (live), or the last step (replay)."""
        steps = self.source.step_range()
        self.selection.select_step(None if self.source.live or steps is None else steps[1])

    def _on_cursor(self, step: int | None) -> None:
        """The time cursor moved: every panel shows that step."""
        self.act_follow.setEnabled(not self.source.live or step is not None)  # End in replay
        steps = self.source.step_range()
        if self.source.live and (step is None or steps is None or step >= steps[1]):
            if step is not None:
                self.selection.select_step(None)  # the newest step: follow it again
                return
            self.show_frame(self.source.newest())
            return
        if step is None:
            return
        try:
            frame = self.source.frame_at(step)
        except SessionError as e:
            self.banner.show_error(f"Cannot show step {step}: {e}")
            return
        self.show_frame(frame)
        self.tree.flush()

    # -------------------------------------------------------------- sessions
    def toggle_recording(self) -> None:
        if self.recording_path is not None:
            self.worker.stop_recording()
            return
        self.act_record.setChecked(False)  # checked once the worker says it records
        if self.source.attached:
            self.banner.show_error("An attached server is recorded from File → Attach… "
                                   "(Record to), or with kvscope attach --record FILE.")
            return
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
        """Without text, the engine saves the session it keeps since the model loaded, when the
        recording stops; with text, it records from now on (the history has no text)."""
        self.worker.start_recording(path, record_text)

    def _on_recording_changed(self, path, note: str) -> None:
        if path is None and self.recording_path is not None:
            self.last_session = self.recording_path
            self._save_recorded_experiments(self.last_session)
        self.recording_path = path
        self.act_record.setChecked(path is not None)
        self.act_record.setText("Stop recording ■" if path else "Record ●")
        self.recording_label.setText(f"● recording {Path(path).name}" if path else "")
        self.statusBar().showMessage(note if path is None else f"{note} to {path}", 8000)

    def _save_experiment(self, result) -> None:
        """A result measured while recording is kept in the recording, written when the
        recording stops (the engine process may write the file only then)."""
        if self.recording_path is not None:
            self._recorded_experiments.append(result)

    def _save_recorded_experiments(self, path: str) -> None:
        from kvscope.sessions.experiments import save_experiment

        results, self._recorded_experiments = self._recorded_experiments, []
        try:
            for result in results:
                save_experiment(path, result)
        except SessionError as e:
            self.banner.show_error(f"Cannot save the experiments in the recording: {e}")

    def open_session_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a recorded session", "",
                                              "kvscope sessions (*.kvscope);;All files (*)")
        if path:
            self.open_session(path)

    def open_session(self, path: str) -> bool:
        """Replay a session file. A bad file shows the banner and changes nothing."""
        try:
            source = ReplaySource.open(path)
        except SessionError as e:
            self.banner.show_error(f"Cannot open the session: {e}")
            return False
        self.worker.pause()
        self.set_source(source)
        try:
            self.experiments.show_results(source.reader.experiments())
        except SessionError as e:
            self.banner.show_error(f"Cannot read the session's experiments: {e}")
        return True

    def open_lab_replay(self, path: str, pool_blocks: int, block_size: int, policy: str,
                        limit: int) -> bool:
        """The Lab panel's what-if run, shown like a replay once its pass (off the GUI thread,
        progress and Cancel) is done. A bad trace changes nothing."""
        from kvscope.app.sources.lab import open_lab_source
        from kvscope.lab.traces import TraceError
        from kvscope.sessions.lab_input import load_lab_input

        def failed(e) -> None:
            self.banner.show_error(f"Cannot open the lab replay: {e}")

        try:
            trace = load_lab_input(path, None, limit)
            self.lab_opening = open_lab_source(self, trace, pool_blocks, block_size, policy,
                                               lambda s: (self.worker.pause(), self.set_source(s)),
                                               failed)
        except (TraceError, OSError, SessionError) as e:
            failed(e)
            return False
        return True

    def attach_dialog(self) -> AttachDialog:
        """File → Attach…: a non-modal dialog; its Attach button calls attach()."""
        dialog = AttachDialog(self)
        dialog.attach_requested.connect(lambda options: self.attach(**options))
        dialog.show()
        self.attach_window = dialog
        return dialog

    def attach(self, endpoint: str, replay: str = "", topic: str = "", metrics: str = "",
               record: str = "", slots: int | None = None, dp_ranks: int = 1) -> bool:
        """Show a server's KV events. A bad address shows the banner and changes nothing."""
        from kvscope.app.sources.attach import AttachSource

        try:
            source = AttachSource(endpoint, replay, topic, metrics, record, dp_ranks=dp_ranks,
                                  **({"num_slots": slots} if slots else {}))
        except ValueError as e:
            self.banner.show_error(f"Cannot attach: {e}")
            return False
        source.on_problem = lambda text: self.banner.show_error(f"Attached to {endpoint}: {text}")
        self.worker.pause()
        self.set_source(source)
        self.recording_label.setText(f"● recording {Path(record).name}" if record else "")
        return True

    @property
    def reader(self):
        """The session being replayed (None: live)."""
        return self.source.reader

    def shown_session(self) -> str | None:
        """The session file behind the steps shown: the replayed file or the live engine's
        history (None: neither, e.g. a lab replay)."""
        if self.reader is not None:
            return str(self.reader.path)
        return self.engine.history_path if self.source.live and self.engine else None

    def set_source(self, source: FrameSource) -> None:
        """Show another source: the panels start empty, then show all it has."""
        if self.source is not self.live and self.source is not source:
            self.source.close()
        self.source = source
        self.banner.hide()
        for panel in self.panels:
            panel.clear()
        self.snapshot = None
        self._show_settings(source)
        self.requests.set_read_only(source.read_only)
        self.composer.set_read_only(source.read_only)
        self.replay_bar.setVisible(not source.live)
        self.replay_bar.play_button.setChecked(False)
        self.selection.reset()
        self.attach_view.set_source(source)
        self.act_detach.setEnabled(source.attached)
        if not source.attached and self.recording_path is None:
            self.recording_label.setText("")
        ours = source.live and not source.attached  # our engine, live
        self.tree.set_identity(self.model_name if ours else
                               str(source.settings().get("model") or ""), not source.live)
        if source.live:
            self.show_frame(source.everything())
            return
        steps = source.step_range()
        first = source.take_frame()
        self.replay_bar.set_session(*steps, first.events)
        self.show_frame(first)
        self.selection.select_step(steps[0])

    def _show_settings(self, source: FrameSource) -> None:
        """In replay the toolbar shows the session's settings, read-only; live, the user's."""
        if source.live and self._live_settings is not None:
            self._set_settings(*self._live_settings)
            self._live_settings = None
        elif not source.live:
            self._live_settings = self._live_settings or (
                self.model_box.currentText(), self.prefix_box.isChecked(),
                self.kv_box.currentText(), self.blocks_box.value(), self.block_size_box.value())
            cfg = source.settings()
            self._set_settings(str(cfg["model"]), cfg.get("enable_prefix_caching") is not False,
                               str(cfg.get("kv_cache_dtype") or "auto"), cfg["num_blocks"],
                               cfg["block_size"])
        policy = None if source.live else source.settings().get("policy")
        self.policy_label.setText(f" policy {policy} ")
        self.policy_shown.setVisible(policy is not None)
        for widget in self.settings_widgets:
            widget.setEnabled(source.live)
            if not isinstance(widget, QAction):
                widget.setToolTip(self._tips[widget] if source.live else
                                  "The session's settings (read-only while replaying)")

    def _set_settings(self, model: str, prefix: bool, kv: str, blocks: int, size: int) -> None:
        self.model_box.setEditText(model)
        self.prefix_box.setChecked(prefix)
        self.kv_box.setCurrentText(kv)
        self.blocks_box.setValue(blocks)
        self.block_size_box.setValue(size)

    def leave_replay(self) -> None:
        """Back to live: the engine's session as it was; with no engine, load the model."""
        if self.source.live:
            return
        self.set_source(self.live)
        if self.engine is None and not self.worker.loading:
            self.status.setText("no model is loaded: loading " +
                                (self.model_box.currentText().strip() or "demo"))
            self.reload()
        else:
            self.status.setText(f"{self.model_name} · live · {HINT}")

    def export_dialog(self) -> list:
        """File → Export…: the replayed session, or the last one recorded."""
        path = str(self.reader.path) if self.reader is not None else self.last_session
        return self.range_export.export_session(path)

    def _watch_request(self, rid) -> None:
        """The selected request's text: the engine sends it (and its output as it grows) with
        its frames; a session file holds it, or says it was recorded without."""
        if rid is None or self.source.live:
            self.worker.watch(rid)
            return
        try:
            text = (recorded_text(self.reader, rid) if self.reader is not None else
                    RequestText(rid, self.source.settings().get("block_size") or 0,
                                note="This source has no text: token counts only."))
        except SessionError as e:
            self.banner.show_error(f"Cannot read the text of #{rid}: {e}")
            return
        self.text.set_text(text)

    def focus_event_filter(self) -> None:
        self.docks["events"].show()
        self.docks["events"].raise_()
        self.events.search.setFocus()

    def explain(self, rid: int) -> None:
        """Why did this miss? As the source explains it at the step shown."""
        try:
            why = self.source.explain(rid, self.selection.step)
        except SessionError as e:
            self.banner.show_error(f"Cannot explain #{rid}: {e}")
            return
        self.docks["details"].raise_()
        if why is None:
            self.details.show_text(f"Request #{rid}", "It had not been admitted by this step: "
                                   "nothing was looked up in the cache yet.")
        else:
            self.details.show_text(f"Why #{rid} missed", why.message)

    # ------------------------------------------------------------- worker
    def _on_model_loaded(self, engine: EngineInfo) -> None:
        self._close_progress()
        self.model_name = self._loading_name
        self.capacity.set_model_config(engine.model_config, self.model_name, engine.cache_dtype)
        self.experiments.model = self.model_name
        self._demo_started = False
        self.worker.pace(self.pace_box.value())  # a new engine process: tell it the pace
        self.live.reset()
        if self.source is self.live:  # not an attached server
            self.set_source(self.live)
        self.status.setText(f"{self.model_name} loaded · {HINT}")

    def _close_progress(self) -> None:
        """The load dialog goes; the window gets the keyboard back (F5 right away)."""
        shown = self.progress.isVisible()
        self.progress.reset()
        if shown:
            self.activateWindow()

    def _on_load_failed(self, message: str, detail: str) -> None:
        self._close_progress()
        self.banner.show_error(f"Could not load the model: {message}", detail)
        self.status.setText(HINT if self.engine else "no model loaded")

    def _on_load_cancelled(self) -> None:
        self.worker.cancel_load()
        self.status.setText("loading cancelled" + (f" · {self.model_name} still loaded"
                                                   if self.engine is not None else ""))

    def _on_engine_error(self, message: str, detail: str) -> None:
        self.banner.show_error(f"The engine stopped on an error (paused; the window keeps "
                               f"running): {message}", detail)

    def _on_not_responding(self, silent: bool) -> None:
        if silent:
            self.banner.show_error(NOT_RESPONDING)
        elif self.banner.label.text() == NOT_RESPONDING:
            self.banner.hide()

    def _on_engine_exited(self, message: str) -> None:
        self.banner.show_error(message)
        self.status.setText("no model loaded")

    def _on_running_changed(self, running: bool) -> None:
        self.running = running  # the status bar says running or paused at once
        self.status.show_frame(self.snapshot, [], self.source, self.selection.step,
                               self.model_name, self.engine, running)

    # -------------------------------------------------------------- frames
    def pull_frame(self) -> None:
        frame = self.source.take_frame()
        if frame is None:
            self._update_tree()  # the source is quiet: the tree catches up with the last frame
            return
        if self.selection.step is not None:  # the user looks at a past step: keep it
            frame = Frame(records=frame.records, events=frame.events, text=frame.text)
        t0 = time.monotonic()
        self.show_frame(frame)
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

    def show_frame(self, frame: Frame) -> None:
        """The one path from a source to the panels."""
        if frame.snapshot is not None:
            self.snapshot = frame.snapshot
        for panel in self.panels:
            panel.show_frame(frame)
        if frame.requests is not None:
            self.composer.show_requests(frame.requests)  # a chat turn's answer
        # The two costly panels take turns; the tree waits TREE_MAX_SKIPS frames at most (a run
        # whose every frame redraws the timeline would draw the tree only at its end).
        if not self.timeline.redrew or self._tree_skips >= TREE_MAX_SKIPS:
            self._update_tree()
        else:
            self._tree_skips += 1
        self.status.show_frame(self.snapshot, frame.records, self.source, self.selection.step,
                               self.model_name, self.engine, self.running)
        self.attach_view.after_frame(frame)

    def _update_tree(self) -> None:
        """The slowest panel: rebuilt at most TREE_HZ times a second, one slice of the rebuild
        per frame (none pays for all of it), and once more after the last frame."""
        now = time.monotonic()
        if self.tree.pending:
            self.tree.advance()
        elif (self.tree.stale and now >= self._tree_due and self.tree.latest is not None
                and not self.docks["tree"].visibleRegion().isEmpty()):
            self.tree.prepare(self.tree.latest)
            self._tree_due, self.tree.stale = now + 1 / TREE_HZ, False
        if not self.tree.pending:
            self._tree_skips = 0  # drawn, or nothing to draw: the tree waits for nothing
