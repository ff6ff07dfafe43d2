"""The main window: dockable panels around the block pool, a toolbar, a status bar. This file is
the wiring; the parts are docks.py (the panels: PANELS), toolbar.py (toolbar, menus, actions),
frame_pump.py (frames, the time cursor), engine_controls.py (the live engine), file_actions.py
(open, record, export), and `open_source`, the one way a source comes to be shown."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QEvent, QSettings, QTimer
from PySide6.QtWidgets import QLabel, QMainWindow, QVBoxLayout, QWidget

from kvscope.app import palette
from kvscope.app.frames import EngineInfo, Frame, RequestText, recorded_text
from kvscope.app.host.client import EngineClient
from kvscope.app.panels.capacity_panel import CapacityPanel
from kvscope.app.panels.composer import Composer
from kvscope.app.panels.details import DetailsPanel
from kvscope.app.panels.device_panel import DevicePanel
from kvscope.app.panels.events_panel import EventsPanel
from kvscope.app.panels.experiments_panel import ExperimentsPanel
from kvscope.app.panels.lab_panel import LabPanel
from kvscope.app.panels.pool_text import block_kv_text
from kvscope.app.panels.pool_view import PoolView
from kvscope.app.panels.prefix_tree_panel import PrefixTreePanel
from kvscope.app.panels.requests_panel import RequestsPanel
from kvscope.app.panels.text_panel import TextPanel
from kvscope.app.panels.timeline import Timeline
from kvscope.app.selection import Selection
from kvscope.app.sources.base import FrameSource
from kvscope.app.sources.fleet_replay import open_replay
from kvscope.app.sources.live import LiveSource
from kvscope.app.window.attach_dialog import AttachDialog
from kvscope.app.window.attach_view import AttachOverlay
from kvscope.app.window.banner import ErrorBanner
from kvscope.app.window.docks import Docks
from kvscope.app.window.engine_controls import EngineControls
from kvscope.app.window.file_actions import FileActions
from kvscope.app.window.fleet_view import FleetOverlay
from kvscope.app.window.frame_pump import FRAME_MS, FramePump
from kvscope.app.window.range_export import RangeExporter
from kvscope.app.window.replay_bar import ReplayBar
from kvscope.app.window.status_line import HINT, StatusLine
from kvscope.app.window.toolbar import EngineSettings, build_menus, build_toolbar
from kvscope.sessions import SessionError


class MainWindow(QMainWindow):
    # the panels of docks.PANELS, by their names (a row added there is an attribute too)
    pool: PoolView
    requests: RequestsPanel
    composer: Composer
    tree: PrefixTreePanel
    details: DetailsPanel
    capacity: CapacityPanel
    device: DevicePanel
    lab: LabPanel
    experiments: ExperimentsPanel
    timeline: Timeline
    events: EventsPanel
    text: TextPanel

    def __init__(self, settings: QSettings | None = None, engine_setup: str | None = None):
        """engine_setup: a Python file each engine process runs first (see host.server.main)."""
        super().__init__()
        self.setWindowTitle("kvscope")
        self.settings = settings or QSettings("kvscope", "kvscope")
        self.selection = sel = Selection()  # the step shown (None: the newest), request, blocks
        self.snapshot = None  # the snapshot shown (the frame pump's)
        self.model_name, self.running = "demo", False  # the engine controls'
        self.recording_path: str | None = None  # the file actions': None when not recording
        self.last_session: str | None = None  # the latest recording, for export
        self.engine_client = EngineClient(engine_setup, parent=self)  # the engine process
        self.live = LiveSource(self.engine_client)
        self.source: FrameSource = self.live
        self.banner = ErrorBanner()
        self.replay_bar = ReplayBar(sel)
        self.replay_bar.hide()
        self.docking = Docks(self, sel)
        self.docks, self.panels = self.docking.docks, self.docking.panels
        for name, panel in self.panels.items():
            setattr(self, name, panel)
        central = QWidget()
        layout = QVBoxLayout(central)
        layout.setContentsMargins(0, 0, 0, 0)
        for widget in (self.banner, self.replay_bar):
            layout.addWidget(widget)
        layout.addWidget(self.pool, 1)
        self.setCentralWidget(central)
        self.docking.place()
        self.frame_pump = FramePump(self)
        self.frame_timer = self.frame_pump.timer
        self.engine_controls = EngineControls(self)
        self.files = FileActions(self)
        self._connect_panels()
        build_toolbar(self)
        build_menus(self)
        self.engine_settings = EngineSettings(self)
        self.engine_controls.connect()
        run, files = self.engine_controls, self.files  # what the CLI, tests and benchmarks call
        self.load_model, self.reload, self.submit, self.pause = (
            run.load_model, run.reload, run.submit, run.pause)
        self.start_recording, self.toggle_recording = files.start_recording, files.toggle_recording
        self.follow, self.reset_layout = self.frame_pump.follow, self.docking.reset
        self.status = StatusLine()
        self.statusBar().addWidget(self.status, 1)
        self.recording_label = QLabel()  # says "● recording <file>" while recording
        self.recording_label.setStyleSheet(f"color: {palette.EVICTED_COLOR}")
        self.statusBar().addPermanentWidget(self.recording_label)
        self.attach_view = AttachOverlay(self)  # only while an attached server is shown
        self.fleet_view = FleetOverlay(self)  # only while an attached fleet is shown
        self.centralWidget().layout().insertWidget(2, self.fleet_view.table)
        self.centralWidget().layout().insertWidget(3, self.attach_view.note)
        self.centralWidget().layout().insertWidget(4, self.attach_view.groups)
        self.statusBar().addPermanentWidget(self.attach_view.health)
        self.frame_timer.start(FRAME_MS)
        self.docking.restore(self.settings)

    def _connect_panels(self) -> None:
        self.replay_bar.leave_requested.connect(self.leave_replay)
        self.range_export = RangeExporter(self, self.shown_session, self.banner.show_error,
                                          lambda text: self.statusBar().showMessage(text, 8000))
        self.timeline.export_range_requested.connect(self.range_export.export)
        self.selection.request_changed.connect(self._watch_request)
        self.lab.open_requested.connect(self.open_lab_replay)
        self.experiments.finished.connect(self.files.save_experiment)
        self.composer.submitted.connect(self.engine_controls.submit)
        self.composer.wants_room.connect(
            lambda: QTimer.singleShot(0, self.docking.fit_composer))
        self.requests.cancel_requested.connect(self.engine_client.cancel)
        self.requests.explain_requested.connect(self.explain)

    # ---------------------------------------------------------------- sources
    def open_source(self, source: FrameSource) -> None:
        """Show a source (live, a session, a lab replay, an attached server): the one way in.
        The panels start empty, then show all it has; the engine pauses while another is shown."""
        if source is not self.live:
            self.engine_client.pause()
        if self.source is not self.live and self.source is not source:
            self.source.close()
        self.source = source
        self.banner.hide()
        for panel in self.panels.values():
            panel.clear()
        self.snapshot = None
        self.engine_settings.show(source)
        settings = source.settings()
        per_token = settings.get("kv_bytes_per_token")
        self.timeline.set_block_bytes(per_token and round(per_token * settings["block_size"]))
        self.details.block_kv = block_kv_text(settings)
        self.pool.set_block_kv(block_kv_text(settings, parts=False))  # one line: owners too
        self.requests.set_read_only(source.read_only)
        self.composer.set_read_only(source.read_only)
        self.replay_bar.setVisible(not source.live)
        self.replay_bar.play_button.setChecked(False)
        self.selection.reset()
        self.attach_view.set_source(source)
        self.fleet_view.set_source(source)
        self.act_detach.setEnabled(source.attached)
        if not source.attached and self.recording_path is None:
            self.recording_label.setText("")
        ours = source.live and not source.attached  # our engine, live
        self.tree.set_identity(self.model_name if ours else
                               str(settings.get("model") or ""), not source.live)
        if source.live:
            self.show_frame(source.everything())
            return
        steps = source.step_range()
        first = source.take_frame()
        self.replay_bar.set_session(*steps, first.events)
        self.show_frame(first)
        self.selection.select_step(steps[0])
        if source.reader is not None:
            try:
                self.experiments.show_results(source.reader.experiments())
            except SessionError as e:
                self.banner.show_error(f"Cannot read the session's experiments: {e}")

    def open_session(self, path: str) -> bool:
        """Replay a session file. A bad file shows the banner and changes nothing."""
        try:
            source = open_replay(path)
        except SessionError as e:
            self.banner.show_error(f"Cannot open the session: {e}")
            return False
        self.open_source(source)
        return True

    def open_lab_replay(self, path: str, pool_blocks: int, block_size: int, policy: str,
                        limit: int, host_blocks: int = 0, ttl_s: float = 0.0) -> bool:
        """The Lab panel's what-if run (with a host tier of `host_blocks`, if any), shown like a
        replay once read and replayed off the GUI thread (progress, Cancel); `ttl_s`: the ttl
        policy's lifetime (0: none). No such file:
        False; a bad trace: the banner, once read."""
        from kvscope.app.sources.lab import open_lab_source

        def failed(e) -> None:
            back()  # the lab's window, if it stepped aside
            self.banner.show_error(f"Cannot open the lab replay: {e}")

        back = self.docking.step_aside("lab")  # the lab's window would cover the replay
        if not Path(path).is_file():
            failed(f"{path}: no such file")
            return False
        self.lab_opening = open_lab_source(self, path, limit, pool_blocks, block_size, policy,
                                           self.open_source, failed, host_blocks, ttl_s or None)
        return True

    def attach_dialog(self) -> AttachDialog:
        """File → Attach…: a non-modal dialog; its Attach button calls attach()."""
        self.attach_window = AttachDialog(self)
        self.attach_window.attach_requested.connect(lambda options: self.attach(**options))
        self.attach_window.show()
        return self.attach_window

    def attach(self, endpoint: str = "", replay: str = "", topic: str = "", metrics: str = "",
               record: str = "", slots: int | None = None, dp_ranks: int = 1,
               fleet: list | None = None) -> bool:
        """Show a server's KV events, or a fleet's (`fleet`: kv_events.fleet.Instance list). A
        bad address shows the banner and changes nothing."""
        from kvscope.app.sources.attach import AttachSource
        from kvscope.app.sources.fleet import FleetSource

        sized = {"num_slots": slots} if slots else {}
        try:
            source = FleetSource(fleet, topic, record, **sized) if fleet else \
                AttachSource(endpoint, replay, topic, metrics, record, dp_ranks=dp_ranks, **sized)
        except ValueError as e:
            self.banner.show_error(f"Cannot attach: {e}")
            return False
        self.open_source(source)
        self.recording_label.setText(f"● recording {Path(record).name}" if record else "")
        return True

    def leave_replay(self) -> None:
        """Back to live: the engine's session as it was; with no engine, load the model."""
        if self.source.live:
            return
        self.open_source(self.live)
        if self.engine is None and not self.engine_client.loading:
            self.status.setText("no model is loaded: loading " +
                                (self.model_box.currentText().strip() or "demo"))
            self.engine_controls.reload()
        else:
            self.status.setText(f"{self.model_name} · live · {HINT}")

    @property
    def engine(self) -> EngineInfo | None:
        """The loaded engine, as far as the window knows it (it runs in its own process)."""
        return self.engine_client.info

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

    def show_frame(self, frame: Frame) -> None:
        """The one path from a source to the panels."""
        self.frame_pump.show(frame)

    # ---------------------------------------------------------------- panels
    def _watch_request(self, rid) -> None:
        """The selected request's text: the engine sends it (and its output as it grows) with
        its frames; a session file holds it, or says it was recorded without."""
        if rid is None or self.source.live:
            self.engine_client.watch(rid)
            return
        try:
            text = (recorded_text(self.reader, rid) if self.reader is not None else
                    RequestText(rid, self.source.settings().get("block_size") or 0,
                                note="This source has no text: token counts only."))
        except SessionError as e:
            self.banner.show_error(f"Cannot read the text of #{rid}: {e}")
            return
        self.text.set_text(text)

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

    def focus_event_filter(self) -> None:
        self.docks["events"].show()
        self.docks["events"].raise_()
        self.events.search.setFocus()

    # ------------------------------------------------------------------ Qt
    def event(self, event) -> bool:
        if event.type() == QEvent.UpdateRequest:  # a paint: the frame pump times a frame's
            return self.frame_pump.timed_paint(event, super().event)
        return super().event(event)

    def closeEvent(self, event) -> None:  # noqa: N802 - Qt API
        self.docking.save(self.settings)
        self.device.stop()
        self.source.close()
        self.live.close()
        self.engine_client.shutdown()  # each engine process finalises its recording first
        super().closeEvent(event)
