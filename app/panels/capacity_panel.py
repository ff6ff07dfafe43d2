"""Capacity: the textbook KV-cache arithmetic for the loaded model or any config.json.

KV bytes per token, and the tokens and requests of a chosen shape that fit in a chosen memory,
in a chosen KV-cache format (the engine's own when it is the loaded model); a table of every
format for the model's layout (scales and zero points included, KIVI's residual per request
apart, capacity vs 16-bit), then the other layouts (MHA, MQA) in the chosen format; a plot of
KV memory per request against context length, one line per attention layout, with the memory
budget as a horizontal line."""

from __future__ import annotations

from pathlib import Path

import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QFont
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QScrollArea,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from kvscope.app import palette, panels
from kvscope.app.panels import capacity_text as words
from kvscope.app.panels.plot_grid import Grid
from kvscope.lab import capacity as cap
from kvscope.lab.capacity import GIB, InvalidConfigError, KVShape
from kvscope.lab.capacity import byte_figure as figure

KIND_COLORS = {"MHA": palette.EVICTED_COLOR, "GQA": palette.ACTIVE_COLOR,
               "MQA": palette.CACHED_COLOR, "MLA": palette.ACTIVE_COLOR}
WIDE_MIN = 600  # px: below this the panel stacks its parts (a side dock)
PLOT_MIN_HEIGHT = 170  # px: the plot never gets less; the panel scrolls instead
PLOT_MIN_WIDTH = 260  # px: beside the table, the plot gets at least this, else goes below it
TABLE_MIN_ROWS = 3  # beside the plot (wide), the table shows at least these rows; stacked, all
class _Body(QWidget):
    """The scrolled part: in a short dock as tall as its parts need at their smallest (the
    plot's and the table's preferred heights would make the user scroll past empty plot)."""

    def __init__(self, on_resize):
        super().__init__()
        self.splitter: QSplitter | None = None
        self.on_resize = on_resize  # the panel places its table once the body has its width

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt API
        super().resizeEvent(event)
        self.on_resize()

    def heightForWidth(self, width: int) -> int:  # noqa: N802 - Qt API
        height = super().heightForWidth(width)
        if self.splitter is not None:
            height -= max(0, self.splitter.sizeHint().height()
                          - self.splitter.minimumSizeHint().height())
        return height


class CapacityPanel(QWidget, panels.FrameIndependent):
    error_occurred = Signal(str)  # one line, also shown in the panel

    def __init__(self, parent=None):
        super().__init__(parent)
        self.shape: KVShape | None = None
        self.model_name = ""
        self.rows: list[cap.Capacity] = []
        self._table_width = 0

        self.preset_box = QComboBox()
        self.preset_box.setToolTip("The model whose numbers are shown: the loaded model, an opened "
                                   "config.json, or a preset for teaching")
        for name, cfg in cap.PRESETS.items():
            self.preset_box.addItem(name, cfg)
        self.open_button = QPushButton("Open config.json…")
        self.open_button.setToolTip("Compute the numbers for any Hugging Face config.json "
                                    "(nothing is downloaded or loaded)")
        self.source_label = QLabel()
        self.source_label.setWordWrap(True)
        self.error_label = QLabel()
        self.error_label.setWordWrap(True)
        self.error_label.setStyleSheet(f"color: {palette.EVICTED_COLOR};")
        self.error_label.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.error_label.hide()
        self.notes_label = QLabel()
        self.notes_label.setWordWrap(True)
        self.notes_label.setStyleSheet("color: #666666;")
        self.notes_label.hide()

        self.memory_box = QDoubleSpinBox()
        self.memory_box.setRange(0.1, 100_000)
        self.memory_box.setDecimals(1)
        self.memory_box.setValue(60.0)
        self.memory_box.setSuffix(" GiB")
        self.memory_box.setGroupSeparatorShown(True)
        self.memory_box.setKeyboardTracking(False)
        self.memory_box.setToolTip(words.TIP_MEMORY)
        self.prompt_box = words.spin(1, 10_000_000, 3072, words.TIP_PROMPT)
        self.output_box = words.spin(0, 10_000_000, 1024, words.TIP_OUTPUT)
        self.dtype_box = QComboBox()  # (label, kv_cache_dtype) of the formats for the shape
        self.dtype_box.setToolTip(words.TIP_DTYPE)
        # sized for "16-bit": the long names are cut in the box (never widening a side
        # dock), whole in its list
        self.dtype_box.setSizeAdjustPolicy(QComboBox.AdjustToMinimumContentsLengthWithIcon)
        self.dtype_box.setMinimumContentsLength(6)
        self.block_size = 16  # the engine's: KIVI's K group is gcd(block_size, 16)

        self.bytes_per_token_label = QLabel()
        self.bytes_per_request_label = QLabel()
        self.tokens_fit_label = QLabel()
        self.requests_fit_label = QLabel()
        self.vs_16_label = QLabel()
        bold = QFont()
        bold.setBold(True)
        for label in (self.bytes_per_token_label, self.bytes_per_request_label,
                      self.tokens_fit_label, self.requests_fit_label, self.vs_16_label):
            label.setFont(bold)
            label.setTextInteractionFlags(Qt.TextSelectableByMouse)

        self.table = QTableWidget(0, len(words.COLUMNS))
        self.table.setHorizontalHeaderLabels(list(words.COLUMNS))
        for i, tip in enumerate(words.TIP_COLUMNS):
            self.table.horizontalHeaderItem(i).setToolTip(tip)
        self.table.verticalHeader().hide()
        self.table.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.table.setSelectionMode(QAbstractItemView.NoSelection)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)
        self.table.verticalHeader().setDefaultSectionSize(22)

        self.plot = pg.PlotWidget(background="w", enableMenu=False)
        self.grid = Grid(self.plot.plotItem, x=True)  # showGrid costs more than the lines
        self.plot.setLabel("left", "KV GiB / request")
        self.plot.setLabel("bottom", "context", units="tokens")
        self.plot.getAxis("left").setWidth(44)
        self.plot.setToolTip("KV memory one request holds against its context length: "
                             "context × KV bytes per token, one line per attention layout at the "
                             "chosen precision. The dashed line is the memory budget: where a "
                             "line crosses it, a single request fills the memory.")
        # The legend is a line above the plot, not a box in it: it never covers a curve.
        self.legend = QLabel()
        self.legend.setWordWrap(True)
        self.legend.setToolTip(self.plot.toolTip())
        self.curves: dict[str, pg.PlotDataItem] = {}
        self.memory_line = pg.InfiniteLine(
            angle=0, movable=False, pen=pg.mkPen("#333333", width=1.5, style=Qt.DashLine))
        self.context_line = pg.InfiniteLine(angle=90, movable=False,
                                            pen=pg.mkPen("#999999", width=1))
        self.plot.addItem(self.memory_line)
        self.plot.addItem(self.context_line)

        top = QHBoxLayout()
        top.addWidget(self.preset_box, 1)
        top.addWidget(self.open_button)
        self.inputs = QGridLayout()
        self.inputs.setHorizontalSpacing(4)
        self.input_pairs = []
        for text, box in (("memory", self.memory_box), ("prompt", self.prompt_box),
                          ("output", self.output_box), ("cache", self.dtype_box)):
            label = QLabel(text)
            label.setToolTip(box.toolTip())
            self.input_pairs.append((label, box))
        self.results = QGridLayout()
        self.results.setHorizontalSpacing(8)
        self.results.setVerticalSpacing(2)
        self.result_names = {}
        self.result_pairs = []
        for text, label in (("KV per token", self.bytes_per_token_label),
                            ("tokens that fit", self.tokens_fit_label),
                            ("KV per request", self.bytes_per_request_label),
                            ("requests that fit", self.requests_fit_label),
                            ("vs 16-bit", self.vs_16_label)):
            name = QLabel(text + ":")
            self.result_names[text] = name
            self.result_pairs.append((name, label))
        chart = QWidget()
        chart_layout = QVBoxLayout(chart)
        chart_layout.setContentsMargins(0, 0, 0, 0)
        chart_layout.setSpacing(0)
        chart_layout.addWidget(self.legend)
        chart_layout.addWidget(self.plot, 1)
        self.plot.setMinimumHeight(PLOT_MIN_HEIGHT)
        split = QSplitter(Qt.Horizontal)
        split.addWidget(self.table)
        split.addWidget(chart)
        split.setStretchFactor(0, 0)
        split.setStretchFactor(1, 1)
        split.setChildrenCollapsible(False)
        self.splitter = split
        # Everything scrolls in a short dock: the parts keep the height they need to be read.
        self.body = _Body(self._place_table)
        self.body.splitter = split
        self.scroll = QScrollArea()
        self.scroll.setWidget(self.body)
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QFrame.NoFrame)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(self.scroll)
        layout = QVBoxLayout(self.body)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.setSpacing(3)
        layout.addLayout(top)
        layout.addWidget(self.source_label)
        layout.addWidget(self.error_label)
        layout.addLayout(self.inputs)
        layout.addLayout(self.results)
        layout.addWidget(self.notes_label)
        layout.addWidget(split, 1)

        self._wide: bool | None = None
        self._reflow(wide=True)
        # Explicit, so the wide layout's larger minimum never stops a dock from narrowing it.
        self.setMinimumSize(320, 240)
        self.preset_box.currentIndexChanged.connect(self._on_preset)
        self.open_button.clicked.connect(self.open_config_dialog)
        for box in (self.memory_box, self.prompt_box, self.output_box):
            box.valueChanged.connect(self._update)
        self.dtype_box.currentIndexChanged.connect(self._update)
        self._on_preset(0)

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt API
        super().resizeEvent(event)
        self._place_table()

    def _place_table(self) -> None:
        """Wide: inputs in one row, and the table beside the plot at its full width where the
        plot keeps PLOT_MIN_WIDTH, else above it. Narrow (a side dock): inputs in two rows,
        results in one column, the table above the plot."""
        wide = self.width() >= WIDE_MIN
        if wide != self._wide:
            self._reflow(wide)
        beside = wide and self._table_width + PLOT_MIN_WIDTH <= self.width()
        self.splitter.setOrientation(Qt.Horizontal if beside else Qt.Vertical)
        header = self.table.horizontalHeader().sizeHint().height() + 2 * self.table.frameWidth()
        row = self.table.verticalHeader().defaultSectionSize()
        if self._table_width > self.table.width() or self.table.horizontalScrollBar().isVisible():
            header += self.table.horizontalScrollBar().sizeHint().height()  # it takes a row
        if beside:
            self.table.setMinimumHeight(header + TABLE_MIN_ROWS * row)
            table = min(self._table_width + 2, int(self.width() * 0.62))
            chart_width = self.splitter.width() - table - self.splitter.handleWidth()
            self.splitter.setSizes([table, max(1, self.splitter.width() - table)])
        else:  # every row the viewport can show: beyond them the panel scrolls, then the table
            table = min(header + self.table.rowCount() * row,
                        max(header + TABLE_MIN_ROWS * row, self.scroll.viewport().height()))
            self.table.setMinimumHeight(table)
            chart_width = self.splitter.width()
            self.splitter.setSizes([table, max(1, self.splitter.height() - table)])
        # A splitter knows no height-for-width: the legend's lines at its width, told outright.
        if chart_width > 50:
            self.legend.setMinimumHeight(max(0, self.legend.heightForWidth(chart_width)))

    def _reflow(self, wide: bool) -> None:
        self._wide = wide
        for grid, pairs, per_row in ((self.inputs, self.input_pairs, 4 if wide else 2),
                                     (self.results, self.result_pairs, 2 if wide else 1)):
            for i, (name, value) in enumerate(pairs):
                grid.removeWidget(name)
                grid.removeWidget(value)
                row, col = divmod(i, per_row)
                grid.addWidget(name, row, 2 * col)
                grid.addWidget(value, row, 2 * col + 1)
            for col in range(8):
                grid.setColumnStretch(col, int(col % 2 == 1 and col < 2 * per_row))

    # ------------------------------------------------------------------ input
    def set_model_config(self, config, name: str, cache_dtype=None, block_size: int = 16
                         ) -> bool:
        """Show the numbers for a config.json dict (or an engine ModelConfig) called name.

        cache_dtype (optional: a kv_cache_dtype such as "int4_per_token_head", or a dtype such
        as "float32" or "torch.bfloat16": the engine's format, "auto" resolved) preselects the
        format the engine really stores; by default the checkpoint's dtype. block_size: the
        engine's (KIVI's K group). An invalid config shows the reason in the panel, emits
        error_occurred and keeps the previous numbers; returns whether the config was used."""
        try:
            shape = KVShape.from_any(config)
        except (InvalidConfigError, KeyError, TypeError) as e:
            self.show_error(f"Cannot use {name}: {e}")
            return False
        index = self.preset_box.findText(name)
        self.preset_box.blockSignals(True)
        if index < 0:
            self.preset_box.insertItem(0, name, config)
            index = 0
        else:
            self.preset_box.setItemData(index, config)
        self.preset_box.setCurrentIndex(index)
        self.preset_box.blockSignals(False)
        self.block_size = block_size
        self._use(shape, name, cache_dtype)
        return True

    def load_config_path(self, path: str | Path) -> bool:
        """Read a config.json file and show its numbers (or the reason it cannot be used)."""
        path = Path(path)
        try:
            cfg = cap.load_config_file(path)
        except InvalidConfigError as e:
            self.show_error(f"Cannot use {path}: {e}")
            return False
        return self.set_model_config(cfg, f"{path.parent.name}/{path.name}")

    def open_config_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a model's config.json", "",
                                              "config.json (*.json);;All files (*)")
        if path:
            self.load_config_path(path)

    def show_error(self, message: str) -> None:
        still = f" Still showing {self.model_name}." if self.model_name else ""
        self.error_label.setText(message + still)
        self.error_label.setToolTip(message)
        self.error_label.show()
        self.error_occurred.emit(message)

    def _on_preset(self, index: int) -> None:
        if index >= 0:
            self.set_model_config(self.preset_box.itemData(index), self.preset_box.itemText(index))

    def _use(self, shape: KVShape, name: str, cache_dtype=None) -> None:
        self.shape, self.model_name = shape, name
        self.error_label.hide()
        formats = cap.formats_for(shape)
        chosen, engine_cache = cap.format_label(shape.dtype), ""
        if cache_dtype is not None:
            label = cap.format_label(str(cache_dtype))
            if label in (f for f, _ in formats):
                engine_cache = f" · engine cache {str(cache_dtype).removeprefix('torch.')}"
                chosen = label
        self.dtype_box.blockSignals(True)
        self.dtype_box.clear()
        for label, fmt in formats:
            self.dtype_box.addItem(label, fmt)
        self.dtype_box.setCurrentText(chosen if chosen in (f for f, _ in formats) else "16-bit")
        self.dtype_box.view().setMinimumWidth(self.dtype_box.view().sizeHintForColumn(0) + 24)
        self.dtype_box.blockSignals(False)
        self.source_label.setText(f"<b>{name}</b>: {shape.describe()}{engine_cache}")
        self.source_label.setToolTip("Read from config.json: num_hidden_layers, "
                                     "num_attention_heads, num_key_value_heads, head_dim (or "
                                     "hidden_size / num_attention_heads), dtype")
        self._update()

    # ---------------------------------------------------------------- compute
    @property
    def memory_bytes(self) -> int:
        return int(round(self.memory_box.value() * GIB))

    @property
    def context_tokens(self) -> int:
        return self.prompt_box.value() + self.output_box.value()

    @property
    def cache_format(self) -> str:
        """The chosen format's kv_cache_dtype ("bfloat16" for 16-bit)."""
        return self.dtype_box.currentData()

    def _update(self) -> None:
        s = self.shape
        if s is None:
            return
        mem, ctx, fmt, bs = self.memory_bytes, self.context_tokens, self.cache_format, \
            self.block_size
        prec = self.dtype_box.currentText()
        bpt = cap.kv_bytes_per_token(s, fmt, bs)
        per_req = cap.bytes_per_request(s, ctx, fmt, bs)
        residual = cap.format_residual_bytes(s, fmt, bs)
        n_tokens = cap.tokens_that_fit(mem, s, fmt, block_size=bs)
        n_req = cap.requests_that_fit(mem, s, ctx, fmt, bs)
        n_16 = cap.tokens_that_fit(mem, s, "bfloat16")
        self.bytes_per_token_label.setText(f"{figure(bpt)} B = {cap.format_bytes(bpt)}")
        self.bytes_per_token_label.setToolTip(
            "KV bytes per token: the K and V all layers store for one token (scales and zero "
            f"points included).\n= {words.bytes_formula(s, fmt, self.block_size)} ({prec})\n"
            f"= {figure(bpt)} bytes")
        apart = f" + {cap.format_bytes(residual)} residual" if residual else ""
        self.bytes_per_request_label.setText(f"{cap.format_bytes(per_req)} "
                                             f"({per_req / 1e9:,.2f} GB){apart}")
        self.bytes_per_request_label.setToolTip(
            "KV bytes per request: the cache one request holds at its full length.\n"
            f"= {s.request_formula(ctx, fmt, bs)}\n= {figure(per_req)} bytes (1 GB = 10^9 B, "
            "1 GiB = 2^30 B)" + (f"\n+ {residual:,} B of KIVI's residual: the K of its open "
                                 "group (up to 15 tokens) in full precision in every layer"
                                 if residual else ""))
        left = f"(memory − {residual:,} B residual)" if residual else "memory"
        self.tokens_fit_label.setText(f"{n_tokens:,} tokens")
        self.tokens_fit_label.setToolTip(
            "Tokens that fit: token positions whose K and V fit in the memory, summed over "
            f"all requests.\n= floor({left} / KV bytes per token) = floor("
            f"{mem - residual:,} B / {figure(bpt)} B)\n= {n_tokens:,}")
        self.requests_fit_label.setText(f"{n_req:,} × {ctx:,} tokens")
        self.requests_fit_label.setToolTip(
            "Requests that fit at once: whole requests of this prompt + output length whose "
            "KV caches fit in the memory together (an upper bound: a paged engine rounds each "
            "request up to whole blocks).\n= floor(memory / (KV bytes per request"
            f"{' + residual' if residual else ''})) = floor({mem:,} B / "
            f"{figure(per_req + residual)} B)\n= {n_req:,}")
        self.vs_16_label.setText(f"{n_tokens / n_16:.2f}× the tokens" if n_16 else "–")
        self.vs_16_label.setToolTip(f"Tokens that fit in {prec} against 16-bit: {n_tokens:,} / "
                                    f"{n_16:,}")
        for text, label in (("KV per token", self.bytes_per_token_label),
                            ("KV per request", self.bytes_per_request_label),
                            ("tokens that fit", self.tokens_fit_label),
                            ("requests that fit", self.requests_fit_label),
                            ("vs 16-bit", self.vs_16_label)):
            self.result_names[text].setToolTip(label.toolTip())
        notes = list(s.notes)
        if s.max_position_embeddings and ctx > s.max_position_embeddings:
            notes.append(f"prompt + output ({ctx:,}) exceeds the model's "
                         f"max_position_embeddings ({s.max_position_embeddings:,})")
        self.notes_label.setText("Note: " + "; ".join(notes) if notes else "")
        self.notes_label.setVisible(bool(notes))
        layouts = cap.variants(s)
        own = [v for v in layouts if v[2]]
        others = [v for v in layouts if not v[2]]
        self.rows = (cap.capacity_table(s, mem, ctx, cap.formats_for(s), bs, own)
                     + cap.capacity_table(s, mem, ctx, [(prec, fmt)], bs, others))
        self._sixteen = {r.num_kv_heads: r.tokens_fit for r in cap.capacity_table(
            s, mem, ctx, cap.PRECISIONS[:1], bs)}
        self._fill_table(mem, ctx)
        self._draw_plot(mem, ctx, fmt)

    def _fill_table(self, mem: int, ctx: int) -> None:
        self.table.setRowCount(len(self.rows))
        bold = QFont()
        bold.setBold(True)
        shapes = {v.num_kv_heads: v for _, v, _own in cap.variants(self.shape)}
        chosen = self.dtype_box.currentText()
        for i, r in enumerate(self.rows):
            s = shapes[r.num_kv_heads]
            sixteen = self._sixteen[r.num_kv_heads]
            cells = words.row_cells(r, s, sixteen, mem, ctx, self.block_size)
            for j, (text, tip) in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setToolTip(tip)
                if j >= 2:
                    item.setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
                if j == 0:
                    item.setForeground(pg.mkColor(KIND_COLORS[r.kind]))
                if r.is_model and r.precision == chosen:
                    item.setFont(bold)
                self.table.setItem(i, j, item)
        self.table.resizeColumnsToContents()
        self._table_width = self.table.horizontalHeader().length() + 2 * self.table.frameWidth()
        self._place_table()

    def _draw_plot(self, mem: int, ctx: int, fmt: str) -> None:
        s = self.shape
        layouts = cap.variants(s)
        x_max = max(s.max_position_embeddings or 0, int(ctx * 1.5), 1024)
        names = [words.short_layout(v.kind, v.num_kv_heads, own) for _, v, own in layouts]
        if list(self.curves) != names:
            for curve in self.curves.values():
                self.plot.removeItem(curve)
            self.curves = {}
            for name, (_, v, own) in zip(names, layouts, strict=True):
                pen = pg.mkPen(KIND_COLORS[v.kind], width=3 if own else 2)
                self.curves[name] = self.plot.plot(name=name, pen=pen)
        xs = sorted({0, x_max, *([s.window] if s.window and s.window < x_max else [])})
        def held(v: KVShape, x: int) -> float:  # its blocks and its residual, in GiB
            return (cap.bytes_per_request(v, x, fmt, self.block_size)
                    + cap.format_residual_bytes(v, fmt, self.block_size)) / GIB

        for name, (_, v, _own) in zip(names, layouts, strict=True):  # bends at the window
            self.curves[name].setData(xs, [held(v, x) for x in xs])
        mem_gib = mem / GIB
        self.memory_line.setValue(mem_gib)
        self.context_line.setValue(ctx)
        # The curves decide the y range; the memory line joins them when it is near enough
        # not to flatten them (within 4x of the steepest), else the legend says where it is.
        top = max(held(v, x_max) for _, v, _own in layouts)
        shown = mem_gib <= 4 * top
        self.memory_line.setVisible(shown)
        self.plot.setXRange(0, x_max, padding=0.02)
        self.plot.setYRange(0, max(top, mem_gib if shown else 0) * 1.05, padding=0.02)
        def item(mark: str, text: str) -> str:  # kept on one line
            return f"{mark}&nbsp;{text.replace(' ', '&nbsp;')}"

        swatches = [item(f'<span style="color:{KIND_COLORS[v.kind]}">━</span>', name)
                    for name, (_, v, _own) in zip(names, layouts, strict=True)]
        memory = f"memory {mem_gib:,.1f} GiB"
        swatches.append(item("╌", memory) if shown else item("", f"{memory} (above the chart)"))
        self.legend.setText(" &nbsp; ".join(swatches))
        self.legend.setToolTip(self.plot.toolTip() if shown else
                               f"The memory budget, {memory}, is above the chart: no request "
                               f"of up to {x_max:,} tokens fills it.")
        self._place_table()
