"""Text: the selected request's prompt and output, cut at token boundaries. The prompt tokens
that came from the prefix cache are shaded apart from those computed for it, a thin tick drawn
between two glyphs marks where each block starts (the text itself is left as it is), and the
output streams in as steps arrive. At a past step the output
is shown as far as it had come; without recorded text, token counts and blocks only."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QPainter, QPen, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import QLabel, QSizePolicy, QTextEdit, QVBoxLayout, QWidget

from kvscope.app import palette
from kvscope.app.frames import Frame, RequestRow, RequestText, admitted
from kvscope.app.selection import Selection


def tint(color: str, t: float = 0.6) -> str:
    """`color` mixed with white: a background that black text stays readable on."""
    r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    return "#{:02x}{:02x}{:02x}".format(*(round(c + (255 - c) * t) for c in (r, g, b)))


CACHED_BG = tint(palette.CACHED_COLOR)  # prompt tokens served from the prefix cache
COMPUTED_BG = tint(palette.PREFILL_COLOR)  # prompt tokens computed (prefill)
OUTPUT_BG = tint(palette.DECODE_COLOR)  # generated tokens (decode)
TICK_COLOR = "#303030"
TICK = "\u258f"  # ▏ the legend's sign for a block start (the view draws a line, not this)
NEWLINE = "\u2028"  # a newline of a prompt or output: a line break that keeps its format
KIND = QTextCharFormat.UserProperty + 1  # what a span of the document is: see the constants
CACHED, COMPUTED, OUTPUT, PLAIN = "cached", "computed", "output", "plain"
KEEP_TEXTS = 64  # texts kept for requests selected before (a step back needs no new ask)


def _swatch(color: str, label: str) -> str:
    return f"<span style='background:{color}'>&nbsp;{label}&nbsp;</span>"


LEGEND = " ".join([_swatch(CACHED_BG, "from the cache"), _swatch(COMPUTED_BG, "computed"),
                   _swatch(OUTPUT_BG, "output"),
                   f"<span style='color:{TICK_COLOR}'>{TICK}</span> block start"])


class TickedText(QTextEdit):
    """A read-only text view that draws a thin tick at each of `ticks` (document positions: a
    block's first character), between that glyph and the one before, over the text: the
    document holds the text alone."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setReadOnly(True)
        self.ticks: list[int] = []

    def clear(self) -> None:
        self.ticks = []
        super().clear()

    def tick_rects(self) -> list:
        """Where each tick is drawn (viewport coordinates): a line's height at the left edge of
        the block's first glyph."""
        cursor = QTextCursor(self.document())
        rects = []
        for pos in self.ticks:
            cursor.setPosition(pos)
            rects.append(self.cursorRect(cursor))
        return rects

    def paintEvent(self, event) -> None:  # noqa: N802 - Qt API
        super().paintEvent(event)
        if not self.ticks:
            return
        painter = QPainter(self.viewport())
        painter.setPen(QPen(QColor(TICK_COLOR), 1))
        shown = event.rect()
        for r in self.tick_rects():
            if r.intersects(shown):
                painter.drawLine(r.left(), r.top() + 1, r.left(), r.bottom())
        painter.end()


class TextPanel(QWidget):
    def __init__(self, selection: Selection | None = None, parent=None):
        super().__init__(parent)
        self.selection = selection or Selection()
        self.selection.request_changed.connect(lambda _rid: self.render())
        self.texts: dict[int, RequestText] = {}
        self.rows: list[RequestRow] = []
        self.title = QLabel()
        # Two lines at most, whatever it says: a title that wraps further never makes the dock,
        # and so the window, taller (the full title is its tooltip)
        self.title.setWordWrap(True)
        self.title.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Fixed)
        self.title.setFixedHeight(2 * self.fontMetrics().lineSpacing() + 2)
        self.title.setAlignment(Qt.AlignLeft | Qt.AlignTop)
        self.title.setTextFormat(Qt.RichText)
        self.legend = QLabel(LEGEND)
        self.legend.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Fixed)
        self.legend.setToolTip("Prompt tokens served from the prefix cache were not computed "
                               "again; a tick marks where each block of the KV cache starts")
        self.view = TickedText()
        self.view.setMinimumHeight(2 * self.fontMetrics().lineSpacing())
        self.view.setPlaceholderText("Select a request to see its prompt and output")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addWidget(self.title)
        layout.addWidget(self.legend)
        layout.addWidget(self.view, 1)
        self._shown: tuple | None = None  # what the document shows (see render)
        self.render()

    # ---------------------------------------------------------------- input
    def show_frame(self, frame: Frame) -> None:
        if frame.text is not None:
            self.set_text(frame.text)
        if frame.requests is not None:
            self.rows = frame.requests
        if frame.text is not None or frame.requests is not None:
            self.render()

    def set_text(self, text: RequestText) -> None:
        """What a source knows of a request's text (kept for when it is selected again)."""
        self.texts.pop(text.request_id, None)
        self.texts[text.request_id] = text
        while len(self.texts) > KEEP_TEXTS:
            del self.texts[next(iter(self.texts))]
        self.render()

    def clear(self) -> None:
        self.texts, self.rows = {}, []
        self.render()

    def _row(self, rid: int | None) -> RequestRow | None:
        for r in reversed(self.rows):  # the newest requests are the likelier selection
            if r.request_id == rid:
                return r
        return None

    # --------------------------------------------------------------- render
    def render(self) -> None:
        """Show the selected request as of the rows shown; only what changed is redrawn (new
        output tokens are appended)."""
        rid = self.selection.request
        row, text = self._row(rid), self.texts.get(rid)
        if rid is None or row is None:
            if self._shown != (rid,):
                self._shown = (rid,)
                self.title.setText("No request selected" if rid is None else
                                   f"#{rid}: not known at this step")
                self.view.clear()
            return
        bs = text.block_size if text is not None else 0
        tokenized = (text is not None and text.prompt is not None
                     and len(text.prompt) == row.prompt_tokens)
        looked_up = admitted(row)
        cached = min(row.cached_tokens, row.prompt_tokens) if looked_up else 0
        n_out = row.output_tokens
        if text is not None and text.output is not None:
            n_out = min(n_out, len(text.output))
        base = (rid, text is not None and (text.note, text.output is not None), tokenized,
                looked_up, cached, row.prompt_tokens)
        self._set_title(row, looked_up, cached, text)
        if self._shown is not None and self._shown[:-1] == base:
            if self._shown[-1] == n_out:
                return
            if self._shown[-1] < n_out and tokenized and text.output is not None:
                self._append_output(text, row.prompt_tokens, self._shown[-1], n_out)
                self._shown = (*base, n_out)
                return
        self._shown = (*base, n_out)
        self.view.clear()
        cursor = QTextCursor(self.view.document())
        cursor.beginEditBlock()  # laid out once at the end, not after every insert
        if text is not None and text.note:
            cursor.insertText(text.note + "\n\n", _format(PLAIN, italic=True))
        if tokenized:
            self._insert_tokens(cursor, text.prompt, 0, cached, bs, looked_up)
            cursor.insertText("\n\n", _format(PLAIN))
            if text.output is not None:
                self._insert_output(cursor, text.output[:n_out], row.prompt_tokens, bs)
            elif text.output_text:
                cursor.insertText(text.output_text.replace("\n", NEWLINE), _format(OUTPUT))
        elif text is not None and text.prompt is not None:  # text, but no token boundaries
            cursor.insertText((text.prompt[0] if text.prompt else "").replace("\n", NEWLINE),
                              _format(PLAIN))
            cursor.insertText("\n\n", _format(PLAIN))
            cursor.insertText((text.output_text or "").replace("\n", NEWLINE), _format(OUTPUT))
        elif bs:  # counts and blocks only
            self._insert_block_spans(cursor, row.prompt_tokens, cached, n_out, bs, looked_up)
        cursor.endEditBlock()
        self.view.moveCursor(QTextCursor.Start)

    def _set_title(self, row: RequestRow, looked_up: bool, cached: int,
                   text: RequestText | None) -> None:
        p = row.prompt_tokens
        if looked_up:
            prompt = (f"prompt {p:,} tokens: <b>{cached:,}</b> from the cache, "
                      f"{p - cached:,} computed")
        else:
            prompt = f"prompt {p:,} tokens (not looked up in the cache)"
        out = f"output {row.output_tokens:,} tokens"
        if text is None:
            out += " · text on its way"
        state = row.state.replace("finished: ", "done: ")
        self.title.setText(f"<b>#{row.request_id}</b> · {state} · {prompt} · {out}")
        self.title.setToolTip(self.title.text())

    # -------------------------------------------------------------- tokens
    def _insert_tokens(self, cursor, pieces, first: int, cached: int, bs: int, shaded: bool,
                       output: bool = False) -> None:
        """Pieces of the tokens at positions first, first + 1, ...: runs of one kind and block
        inserted at once (each run's tooltip names its block), a tick at each block's first
        token (position % bs == 0, past the first)."""
        run, kind = [], None
        for i, piece in enumerate(pieces):
            pos = first + i
            k = OUTPUT if output else (CACHED if pos < cached else COMPUTED) if shaded \
                else PLAIN
            boundary = bs and pos % bs == 0 and pos > 0
            if run and (k != kind or boundary):
                cursor.insertText("".join(run).replace("\n", NEWLINE), _format(kind, block=(
                    pos - 1) // bs if bs else None))
                run = []
            if boundary:
                self.view.ticks.append(cursor.position())
            run.append(piece)
            kind = k
        if run:
            pos = first + len(pieces) - 1
            cursor.insertText("".join(run).replace("\n", NEWLINE),
                              _format(kind, block=pos // bs if bs else None))

    def _insert_output(self, cursor, pieces, prompt_tokens: int, bs: int) -> None:
        self._insert_tokens(cursor, pieces, prompt_tokens, 0, bs, True, output=True)

    def _append_output(self, text: RequestText, prompt_tokens: int, start: int,
                       end: int) -> None:
        bar = self.view.verticalScrollBar()
        at_end = bar.value() >= bar.maximum()
        cursor = QTextCursor(self.view.document())
        cursor.movePosition(QTextCursor.End)
        cursor.beginEditBlock()
        self._insert_tokens(cursor, text.output[start:end], prompt_tokens + start, 0,
                            text.block_size, True, output=True)
        cursor.endEditBlock()
        if at_end:
            bar.setValue(bar.maximum())  # streaming in: follow it, unless the user scrolled up

    def _insert_block_spans(self, cursor, prompt: int, cached: int, n_out: int, bs: int,
                            looked_up: bool) -> None:
        """Without text: each block as its token range, shaded as its tokens would be."""
        def block_spans(lo: int, hi: int, kind_of) -> None:
            pos = lo
            while pos < hi:
                end = min(hi, (pos // bs + 1) * bs)
                if pos % bs == 0 and pos > 0:
                    self.view.ticks.append(cursor.position())
                cursor.insertText(f" {pos}–{end - 1} ", _format(kind_of(pos), block=pos // bs))
                pos = end

        cursor.insertText(f"Prompt: {prompt:,} tokens in {-(-prompt // bs)} blocks of {bs}\n",
                          _format(PLAIN, italic=True))
        block_spans(0, prompt, lambda pos: (CACHED if pos < cached else COMPUTED) if looked_up
              else PLAIN)
        cursor.insertText(f"\n\nOutput: {n_out:,} tokens\n", _format(PLAIN, italic=True))
        block_spans(prompt, prompt + n_out, lambda pos: OUTPUT)


_BG = {CACHED: CACHED_BG, COMPUTED: COMPUTED_BG, OUTPUT: OUTPUT_BG}


def _format(kind: str, italic: bool = False, block: int | None = None) -> QTextCharFormat:
    """block: the KV block the text's tokens are in (its tooltip says so)."""
    fmt = QTextCharFormat()
    fmt.setProperty(KIND, kind)
    if kind in _BG:
        fmt.setForeground(QColor("#000000"))
        fmt.setBackground(QColor(_BG[kind]))
    if italic:
        fmt.setFontItalic(True)
    if block is not None:
        fmt.setToolTip(f"block {block} (a tick marks where each block starts)")
    return fmt


def spans(document) -> list[tuple[str, str]]:
    """(kind, text) of each run of the document: what the view shows, for tests and export."""
    out = []
    block = document.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            frag = it.fragment()
            if frag.isValid():
                kind = frag.charFormat().property(KIND) or PLAIN
                text = frag.text().replace(NEWLINE, "\n")
                if out and out[-1][0] == kind:
                    out[-1] = (kind, out[-1][1] + text)
                else:
                    out.append((kind, text))
            it += 1
        block = block.next()
        if block.isValid():  # a paragraph break: between the parts, never inside a text
            out.append((PLAIN, "\n"))
    return out


def text_of(document, kind: str) -> str:
    """Everything of one kind the document shows, joined."""
    return "".join(t for k, t in spans(document) if k == kind)
