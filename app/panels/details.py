"""Details / Why it missed: the selected block or request explained in words."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QFrame,
    QLabel,
    QScrollArea,
    QSizePolicy,
    QTextBrowser,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from kvscope.app.frames import Frame
from kvscope.app.panels.pool_groups import NO_GROUP, block_groups, explain_group
from kvscope.app.panels.pool_host import HOST_TIP, TIER_TIP, describe_host_block, lower_cell
from kvscope.app.panels.pool_text import describe_block
from kvscope.app.selection import Selection
from kvscope.sessions.kv_events.slots import forms_text

HOW_TO_READ = (
    "Each cell of the block pool is one physical KV block "
    "(block_size token slots in every layer). Blue blocks hold one request's tokens, orange "
    "blocks are shared by several requests (deeper orange = more owners), green blocks are "
    "cached: no request holds them but their hash is kept, so a later prompt with the same "
    "prefix reuses them (darker green = evicted sooner, in LRU order). A vermilion outline marks "
    "blocks evicted in the step shown; a black outline the selected request's blocks.")


class _HelpArea(QScrollArea):
    """Asks for the height of the whole help (its maximum, set to the text's height at this
    width); it gets less, and scrolls, only where the dock is short."""

    def sizeHint(self):  # noqa: N802 - Qt API
        hint = super().sizeHint()
        hint.setHeight(min(self.maximumHeight(), 10 * hint.height()))
        return hint


class DetailsPanel(QWidget):
    def __init__(self, selection: Selection | None = None, parent=None):
        super().__init__(parent)
        self.selection = selection or Selection()
        self.selection.blocks_changed.connect(self._describe_block)
        self.selection.host_blocks_changed.connect(self._describe_host_block)
        self.snapshot = None
        self.block_kv = ""  # a block's format and bytes (pool_text.block_kv_text)
        self.help = QLabel(HOW_TO_READ)
        self.help.setWordWrap(True)
        self.help.setAlignment(Qt.AlignLeft | Qt.AlignTop)
        # The help scrolls when the dock is short: never cut off mid-line, never over the
        # answer. It takes the height its text needs and no more.
        self.help_area = _HelpArea()
        self.help_area.setWidget(self.help)
        self.help_area.setWidgetResizable(True)
        self.help_area.setFrameShape(QFrame.NoFrame)
        self.help_area.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.help_area.setSizePolicy(QSizePolicy.Preferred, QSizePolicy.Maximum)
        self.help_area.setMinimumHeight(2 * self.fontMetrics().lineSpacing())
        self.help_button = QToolButton()  # collapses the help: the answers get its room
        self.help_button.setText("How to read this window")
        self.help_button.setCheckable(True)
        self.help_button.setChecked(True)
        self.help_button.setToolButtonStyle(Qt.ToolButtonTextBesideIcon)
        self.help_button.setArrowType(Qt.DownArrow)
        self.help_button.setStyleSheet("QToolButton { border: none; font-weight: bold; }")
        self.help_button.toggled.connect(self._show_help)
        self.text = QTextBrowser()
        self.text.setOpenLinks(False)  # "step:N" links move the time cursor
        self.text.anchorClicked.connect(self._on_link)
        self.text.setPlaceholderText("Select a request and press “Why did this miss?”, or "
                                     "click a block")
        self.text.setMinimumHeight(3 * self.fontMetrics().lineSpacing())
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.setSpacing(2)
        layout.addWidget(self.help_button)
        layout.addWidget(self.help_area)
        layout.addWidget(self.text, 1)

    def _show_help(self, shown: bool) -> None:
        self.help_area.setVisible(shown)
        self.help_button.setArrowType(Qt.DownArrow if shown else Qt.RightArrow)
        self._fit_help()

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt API
        super().resizeEvent(event)
        self._fit_help()

    def _fit_help(self) -> None:
        """The help's room: its text's height at this width, less when the answer would get
        fewer than its minimum lines (then the help scrolls)."""
        width = self.help_area.width() or self.width()
        height = self.help.heightForWidth(width) + 2
        if height != self.help_area.maximumHeight():
            self.help_area.setMaximumHeight(height)
            self.help_area.updateGeometry()

    def show_frame(self, frame: Frame) -> None:
        if frame.snapshot is not None:
            self.snapshot = frame.snapshot

    def clear(self) -> None:
        self.snapshot = None
        self.text.clear()

    def _describe_block(self, blocks) -> None:
        """One block picked (a click in the pool or the tree): what it holds at this step, and
        a link to the step that last used it; with several KV-cache groups, what its group
        keeps."""
        snap = self.snapshot
        if len(blocks) == 1 and snap is not None:
            block = blocks[0]
            body = describe_block(snap, block, kv=self.block_kv)
            group = block_groups(snap)[block] if len(snap.groups) > 1 else NO_GROUP
            if group != NO_GROUP:
                body += "<br>" + explain_group(snap.groups[group])
            last = int(self.snapshot.last_use[block])
            if last >= 0:
                body += f'<br><a href="step:{last}">Show step {last}, which last used it</a>'
            self.show_text(f"Block {block}", body)

    def _describe_host_block(self, cells) -> None:
        """One block of a tier below the device's picked in the pool (the host tier's; an
        attached server's CPU or STORAGE): what it holds at this step."""
        snap = self.snapshot
        found = None if len(cells) != 1 or snap is None else lower_cell(snap, cells[0])
        if found is not None:
            tier, block = found
            body = describe_host_block(snap, cells[0]) + "<br>" + (
                f"The {tier.medium} tier: {forms_text(tier.forms)}. {TIER_TIP}" if tier.medium
                else HOST_TIP)
            last = int(tier.last_use[block])
            if last >= 0:
                body += f'<br><a href="step:{last}">Show step {last}, which last used it</a>'
            self.show_text(f"{tier.medium} hash slot {block}" if tier.medium else
                           f"Host block {block}", body)

    def _on_link(self, url) -> None:
        if url.scheme() == "step":
            self.selection.select_step(int(url.path()))

    def show_text(self, title: str, body: str) -> None:
        """Show an answer. The help folds away the first time (a click brings it back): an
        answer needs the room more than the help, once the window has been read."""
        if not self._answered and self.help_button.isChecked():
            self.help_button.setChecked(False)
        self._answered = True
        self.text.setHtml(f"<p><b>{title}</b></p><p>{body}</p>")

    _answered = False
