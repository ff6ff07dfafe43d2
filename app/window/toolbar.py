"""The toolbar, the menus and the window's keyboard actions. They are the window's attributes
(tests and the CLI reach them there): model_box, pace_box, prefix_box, kv_box, blocks_box,
block_size_box, host_blocks_box (in the Engine menu: the toolbar is full at 1280 px),
policy_label, and act_open_model, act_demo, act_workload, act_pause, act_step, act_filter,
act_back, act_first, act_follow, act_record, act_open_session, act_export, act_apply,
act_attach, act_detach, act_reset_layout; view_menu, engine_menu. `EngineSettings` shows, in
the toolbar, the settings of the source shown (the session's, read-only, in replay)."""

from __future__ import annotations

from PySide6.QtCore import QEvent, Qt
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QHBoxLayout,
    QLabel,
    QSpinBox,
    QToolTip,
    QWidget,
    QWidgetAction,
)

from kvscope.app.sources.base import FrameSource
from kvscope.app.window.engine_controls import DEMO_PACE
from kvscope.engine.config import DEFAULT_CPU_BLOCKS, KV_CACHE_DTYPES


def _action(w, text: str, shortcut: str, slot) -> QAction:
    action = QAction(text, w)
    action.setShortcut(QKeySequence(shortcut))
    action.setToolTip(f"{text} ({shortcut})")
    action.triggered.connect(slot)
    w.addAction(action)
    return action


class ModelBox(QComboBox):
    """The Model list: picking an entry loads it, Enter loads what was typed (a folder, a file,
    a repo id). The box is as wide as a short name, so its tooltip starts with the whole name
    shown; the mouse wheel never changes (and loads) the model."""

    def __init__(self, pick, enter):
        super().__init__()
        self.setEditable(True)
        self.setInsertPolicy(QComboBox.NoInsert)  # a typed name that fails is not listed
        self.addItem("demo", "demo")
        self.addItem("SmolLM2-135M-Instruct (real)", "smollm2")
        self.addItem("demo-hybrid (sliding window 128 on half the layers)", "demo-hybrid")
        # As wide as a short name, not the longest entry: the toolbar must fit 1280 px.
        self.setMaximumWidth(self.fontMetrics().horizontalAdvance("demo") + 40)
        self.view().setMinimumWidth(self.view().sizeHintForColumn(0) + 24)
        self.setToolTip("Pick a model to load it: demo, demo-hybrid (two KV-cache groups), "
                        "SmolLM2, or type a local model folder, "
                        "a .gguf file, or a repo id in the local Hugging Face cache and press "
                        "Enter")
        self.activated.connect(lambda i: pick(self.itemData(i)))
        self.lineEdit().returnPressed.connect(enter)
        # A long name shows its start ("SmolLM2-13…"), not its end ("…ct (real)").
        self.currentIndexChanged.connect(lambda _i: self.lineEdit().setCursorPosition(0))

    def show_model(self, name: str) -> None:
        """Show a model by its name ("smollm2" as its entry's text)."""
        i = self.findData(name)
        self.setEditText(self.itemText(i) if i >= 0 else name)
        self.lineEdit().setCursorPosition(0)

    def event(self, e) -> bool:
        if e.type() == QEvent.ToolTip and self.toolTip():
            QToolTip.showText(e.globalPos(), f"{self.currentText()}\n\n{self.toolTip()}", self)
            return True
        return super().event(e)

    def wheelEvent(self, e) -> None:  # noqa: N802 - Qt API
        e.ignore()  # scrolling over the toolbar loads nothing


def build_toolbar(w) -> None:
    run, files, pump = w.engine_controls, w.files, w.frame_pump
    tb = w.addToolBar("Main")
    tb.setObjectName("toolbar_main")
    w.model_box = ModelBox(run.pick, run.reload)
    tb.addWidget(QLabel(" Model "))
    tb.addWidget(w.model_box)
    w.act_open_model = _action(w, "Open model…", "Ctrl+L", files.open_model_folder)
    tb.addSeparator()
    w.act_demo = _action(w, "Run demo ▶", "F5", run.run_or_resume)
    w.act_workload = _action(w, "Run workload…", "Ctrl+W", files.open_workload)
    w.act_pause = _action(w, "Pause ❚❚", "Space", run.pause)
    w.act_step = _action(w, "Step ›", "N", run.step_once)
    w.act_step.setShortcuts([QKeySequence("N"), QKeySequence(Qt.Key_Right)])
    w.act_step.setToolTip("Step (N or →); in replay, the next recorded step")
    w.act_filter = _action(w, "Filter events", "Ctrl+F", w.focus_event_filter)
    w.act_back = _action(w, "Step back", "Left", lambda: pump.move_cursor(-1))
    w.act_back.setToolTip("The previous step (←): live, this looks back in the history")
    w.act_first = _action(w, "First step", "Home", pump.first_step)
    w.act_first.setToolTip("The first step kept (Home), live or in replay")
    w.act_follow = _action(w, "Follow live", "End", pump.follow)
    w.act_follow.setToolTip("Show the newest step again (End); in replay, the last step")
    w.act_follow.setEnabled(False)
    w.act_record = _action(w, "Record ●", "Ctrl+R", files.toggle_recording)
    w.act_record.setCheckable(True)
    w.act_open_session = _action(w, "Open session…", "Ctrl+O", files.open_session_dialog)
    w.act_export = _action(w, "Export…", "Ctrl+E", files.export_dialog)
    for a in (w.act_demo, w.act_pause, w.act_step):
        tb.addAction(a)
    w.pace_box = QSpinBox(minimum=0, maximum=1000, value=DEMO_PACE, suffix=" /s")
    w.pace_box.setSpecialValueText("max")
    w.pace_box.setToolTip("Pace: how many steps a second the engine runs (0, max: as fast as "
                          "it can); slow enough to watch by default")
    w.pace_box.valueChanged.connect(w.engine_client.pace)
    tb.addWidget(w.pace_box)
    for a in (w.act_follow, w.act_record, w.act_open_session):
        tb.addAction(a)
    # "Stop recording ■" is wider than "Record ●": the button keeps the wider width, so
    # the toolbar never shifts when recording starts or stops.
    record = tb.widgetForAction(w.act_record)
    record.setFixedWidth(record.fontMetrics().horizontalAdvance("Stop recording ■") + 16)
    w.addAction(w.act_filter)
    tb.addSeparator()
    w.prefix_box = QCheckBox("prefix cache")
    w.prefix_box.setChecked(True)
    w.kv_box = QComboBox()
    w.kv_box.addItems(list(KV_CACHE_DTYPES))
    # sized for "bfloat16": the long quantized names are cut in the box, whole in its list
    w.kv_box.setSizeAdjustPolicy(QComboBox.AdjustToMinimumContentsLengthWithIcon)
    w.kv_box.setMinimumContentsLength(6)
    w.kv_box.view().setMinimumWidth(w.kv_box.view().sizeHintForColumn(0) + 24)
    w.kv_box.setToolTip("KV cache format: auto (the model's dtype), 16/32-bit, fp8 (a scale per "
                        "layer or per head), int8/int4 per token and head, KIVI 4/2-bit")
    w.blocks_box = QSpinBox(minimum=4, maximum=1 << 20, value=DEFAULT_CPU_BLOCKS)
    w.block_size_box = QSpinBox(minimum=1, maximum=256, value=16)
    w.blocks_box.setToolTip("Physical blocks in the KV pool")
    w.block_size_box.setToolTip("Tokens per block")
    tb.addWidget(w.prefix_box)
    for label, box in ((" kv ", w.kv_box), (" blocks ", w.blocks_box), (" × ", w.block_size_box)):
        tb.addWidget(QLabel(label))
        tb.addWidget(box)
    w.act_apply = _action(w, "Apply (reload)", "Ctrl+Shift+R", run.reload)
    tb.addAction(w.act_apply)
    w.policy_label = QLabel()  # a replayed session's eviction policy, when recorded
    w.policy_label.setToolTip("The session's eviction policy")
    w.policy_shown = tb.addWidget(w.policy_label)
    w.policy_shown.setVisible(False)


def build_menus(w) -> None:
    file_menu = w.menuBar().addMenu("&File")
    for a in (w.act_open_model, w.act_workload, w.act_open_session, w.act_record, w.act_export):
        file_menu.addAction(a)
    file_menu.addSeparator()
    w.act_attach = file_menu.addAction("Attach…", w.attach_dialog)
    w.act_attach.setShortcut(QKeySequence("Ctrl+Shift+A"))
    w.act_attach.setToolTip("Show a vLLM/SGLang server's KV cache from its KV events")
    w.act_detach = file_menu.addAction("Detach", lambda: w.open_source(w.live))
    w.act_detach.setEnabled(False)
    w.view_menu = w.menuBar().addMenu("&View")
    for action in w.docking.view_actions():
        if action is None:
            w.view_menu.addSeparator()
        else:
            w.view_menu.addAction(action)
    w.view_menu.addSeparator()
    w.view_menu.addAction(w.timeline.act_wall_clock)
    w.timeline.plots_menu.setTitle("Timeline plots")
    w.view_menu.addMenu(w.timeline.plots_menu)  # the plots' right-click menu has it too
    w.timeline.use_settings(w.settings)
    w.act_reset_layout = w.view_menu.addAction("Reset layout", w.docking.reset)
    build_engine_menu(w)


HOST_TIP = ("A host tier behind the pool: this many blocks in host memory (0: none). A cached "
            "block evicted from the pool is copied there; a prompt that misses on the device "
            "and hits there is loaded back. Applied with Apply (reload), as the pool's size")


def build_engine_menu(w) -> None:
    """The engine's settings that the toolbar has no room for: the host tier's size, applied
    with Apply (reload) like the pool's."""
    w.engine_menu = w.menuBar().addMenu("&Engine")
    w.host_blocks_box = QSpinBox(minimum=0, maximum=1 << 22, value=0, suffix=" blocks")
    w.host_blocks_box.setSpecialValueText("none")
    w.host_blocks_box.setToolTip(HOST_TIP)
    row = QWidget()
    layout = QHBoxLayout(row)
    layout.setContentsMargins(8, 2, 8, 2)
    layout.addWidget(QLabel("Host tier"))
    layout.addWidget(w.host_blocks_box)
    row.setToolTip(HOST_TIP)
    host = QWidgetAction(w)
    host.setDefaultWidget(row)
    w.engine_menu.addAction(host)
    w.engine_menu.addSeparator()
    w.engine_menu.addAction(w.act_apply)


class EngineSettings:
    """The toolbar's engine settings: the user's while live; in replay the session's, read-only
    (the user's come back with live). In replay the engine's Run demo, Pause, Step and pace are
    off: the replay bar has its own (and takes their keys)."""

    def __init__(self, w):
        self.w = w
        self.widgets = (w.model_box, w.act_open_model, w.prefix_box, w.kv_box, w.blocks_box,
                        w.block_size_box, w.host_blocks_box, w.act_apply)
        self._tips = {x: x.toolTip() for x in self.widgets}
        self._live: tuple | None = None  # the user's, kept while replaying

    def show(self, source: FrameSource) -> None:
        w = self.w
        if source.live and self._live is not None:
            self._set(*self._live)
            self._live = None
        elif not source.live:
            self._live = self._live or (
                w.model_box.currentText(), w.prefix_box.isChecked(), w.kv_box.currentText(),
                w.blocks_box.value(), w.block_size_box.value(), w.host_blocks_box.value())
            cfg = source.settings()
            self._set(str(cfg["model"]), cfg.get("enable_prefix_caching") is not False,
                      str(cfg.get("kv_cache_dtype") or "auto"), cfg["num_blocks"],
                      cfg["block_size"], cfg.get("host_blocks") or 0)
        policy = None if source.live else source.settings().get("policy")
        w.policy_label.setText(f" policy {policy} ")
        w.policy_shown.setVisible(policy is not None)
        for widget in (*self.widgets, w.act_demo, w.act_pause, w.act_step, w.pace_box):
            widget.setEnabled(source.live)
        for widget in self.widgets:
            if not isinstance(widget, QAction):
                widget.setToolTip(self._tips[widget] if source.live else
                                  "The session's settings (read-only while replaying)")

    def _set(self, model: str, prefix: bool, kv: str, blocks: int, size: int,
             host: int) -> None:
        w = self.w
        w.host_blocks_box.setValue(host)
        w.model_box.show_model(model)
        w.prefix_box.setChecked(prefix)
        w.kv_box.setCurrentText(kv)
        w.blocks_box.setValue(blocks)
        w.block_size_box.setValue(size)
