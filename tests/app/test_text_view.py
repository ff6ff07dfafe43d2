"""The Text dock: the selected request's prompt with the tokens that came from the cache shaded
apart from the computed ones, a tick where each block starts, the output streaming in; in replay
the recorded text when the session has it, else token counts, blocks and a note."""

from __future__ import annotations

from pathlib import Path

import pytest
from PySide6.QtCore import QPointF, Qt
from window_testutil import open_replay, step

from kvscope.app.frames import NO_TEXT
from kvscope.app.panels.text_panel import (
    CACHED,
    CACHED_BG,
    COMPUTED,
    COMPUTED_BG,
    OUTPUT,
    OUTPUT_BG,
    PLAIN,
    text_of,
)
from kvscope.app.window.main_window import MainWindow
from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.token_text import token_pieces

SHARED = "Shared notes on lists and tuples, written for the course. " * 4
FIRST, SECOND = SHARED + "First question?", SHARED + "And what about sets?"
BS = 16


def tokenizer():
    from kvscope.engine.models.load import _load_tokenizer

    return _load_tokenizer(Path(__file__).parents[2] / "resources" / "demo")


def click_row(window, qtbot, rid) -> None:
    table = window.requests.table
    row = [r.request_id for r in window.requests.model.rows].index(rid)
    qtbot.mouseClick(table.viewport(), Qt.LeftButton,
                     pos=table.visualRect(window.requests.model.index(row, 0)).center())


def backgrounds(document) -> dict[str, str]:
    """Background colour -> the text drawn on it, read from the document's char formats."""
    out: dict[str, str] = {}
    block = document.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            frag = it.fragment()
            fmt = frag.charFormat()
            if fmt.background().style() != Qt.NoBrush:
                color = fmt.background().color().name()
                out[color] = out.get(color, "") + frag.text()
            it += 1
        block = block.next()
    return out


def ticks_before(n: int) -> int:
    """Block starts among token positions 1 .. n - 1."""
    return (n - 1) // BS


def row_of(window, rid):
    return next(r for r in window.requests.model.rows if r.request_id == rid)


def test_live_text_shades_the_cached_prompt_and_the_output_streams_in(window, qtbot):
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    window.resize(1280, 720)  # selecting and streaming never make the window bigger
    qtbot.waitUntil(lambda: window.height() == 720)
    window.engine_client.submit(FIRST, SamplingParams(max_tokens=2, ignore_eos=True), None)
    step(window, qtbot, 2)  # prefill and one decode: finished
    window.engine_client.submit(SECOND, params, None)
    step(window, qtbot, 2)  # the second prompt hit the first's blocks, and sampled
    window.docks["text"].raise_()
    click_row(window, qtbot, 1)
    doc = window.text.view.document()
    qtbot.waitUntil(lambda: text_of(doc, CACHED) != "", timeout=5000)

    pieces = token_pieces(tokenizer(), tokenizer().encode(SECOND))
    row = row_of(window, 1)
    cached = row.cached_tokens
    assert row.prompt_tokens == len(pieces) and BS <= cached < len(pieces) and cached % BS == 0
    assert text_of(doc, CACHED) == "".join(pieces[:cached])
    assert text_of(doc, COMPUTED) == "".join(pieces[cached:])
    colours = backgrounds(doc)  # the char formats, not only the kinds
    assert colours[CACHED_BG] == "".join(pieces[:cached])
    assert colours[COMPUTED_BG] == "".join(pieces[cached:])
    assert CACHED_BG != COMPUTED_BG != OUTPUT_BG
    shown_out = row.output_tokens
    ticks = ticks_before(row.prompt_tokens + shown_out)
    assert len(window.text.view.ticks) == ticks  # drawn over the text, not in it
    first_out = text_of(doc, OUTPUT)
    assert first_out and colours[OUTPUT_BG].replace("\u2028", "\n") == first_out

    step(window, qtbot, 4)  # the output grows in place, the prompt stays
    qtbot.waitUntil(lambda: len(text_of(doc, OUTPUT)) > len(first_out), timeout=5000)
    assert text_of(doc, OUTPUT).startswith(first_out)
    assert text_of(doc, CACHED) == "".join(pieces[:cached])
    assert "#1" in window.text.title.text() and f"{cached:,}</b> from the cache" in \
        window.text.title.text()

    # A step back (the engine's history, kept without text): the same prompt and cached span,
    # the output as far as it had come then.
    grown = text_of(doc, OUTPUT)
    back = window.snapshot.step - 2
    qtbot.wait(600)  # the history is committed every 0.25 s
    window.selection.select_step(back)
    qtbot.waitUntil(lambda: window.snapshot.step == back, timeout=5000)
    qtbot.waitUntil(lambda: len(text_of(doc, OUTPUT)) < len(grown), timeout=5000)
    assert grown.startswith(text_of(doc, OUTPUT))
    assert text_of(doc, CACHED) == "".join(pieces[:cached])

    click_row(window, qtbot, 0)  # another request, still at that step: its prompt, all
    qtbot.waitUntil(lambda: text_of(doc, CACHED) == "" and  # computed (a cold cache)
                    text_of(doc, COMPUTED).startswith("Shared notes"), timeout=5000)
    window.follow()

    # A click on a pool cell that only #1 holds selects #1: its text again, as it was.
    snap = window.snapshot
    own = [b for b in snap.block_tables[1].tolist() if snap.ref_count[b] == 1][0]
    x, y = window.pool.cell_center(own)
    pos = window.pool.plot.mapFromScene(window.pool.plot.plotItem.vb.mapViewToScene(
        QPointF(x, y)))
    qtbot.mouseClick(window.pool.plot.viewport(), Qt.LeftButton, pos=pos)
    assert window.selection.request == 1
    qtbot.waitUntil(lambda: text_of(doc, CACHED) == "".join(pieces[:cached]), timeout=5000)
    assert text_of(doc, OUTPUT).startswith(first_out)
    assert (window.width(), window.height()) == (1280, 720)


def record(path, record_text: bool) -> None:
    from kvscope.engine import Engine
    from kvscope.sessions import Recorder

    engine = Engine.from_pretrained("demo", EngineConfig(num_blocks=64, block_size=BS))
    with Recorder(path, engine, record_text=record_text):
        engine.add_request(FIRST, SamplingParams(max_tokens=2, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        engine.add_request(SECOND, SamplingParams(max_tokens=8, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text")
    paths = {}
    for with_text in (True, False):
        paths[with_text] = folder / f"text-{with_text}.kvscope"
        record(paths[with_text], with_text)
    return paths


def replay_window(qtbot, tmp_path, path) -> MainWindow:
    w = open_replay(qtbot, tmp_path, path)
    w.docks["text"].raise_()
    return w


def test_replay_with_text_shows_it_shaded_and_the_output_as_of_the_step(qtbot, tmp_path,
                                                                         sessions):
    from kvscope.sessions import SessionReader

    w = replay_window(qtbot, tmp_path, sessions[True])
    last = w.source.step_range()[1]
    w.replay_bar.set_step(last)
    click_row(w, qtbot, 1)
    doc = w.text.view.document()
    with SessionReader(sessions[True]) as r:
        rec = r.request(1)
    pieces = token_pieces(tokenizer(), tokenizer().encode(SECOND))
    cached = rec.cached_tokens
    assert BS <= cached < len(pieces)
    assert backgrounds(doc)[CACHED_BG] == "".join(pieces[:cached])
    assert text_of(doc, COMPUTED) == "".join(pieces[cached:])
    assert text_of(doc, OUTPUT) == rec.output_text and rec.output_tokens == 8
    assert len(w.text.view.ticks) == ticks_before(rec.prompt_tokens + 8)

    w.replay_bar.set_step(last - 4)  # four output tokens fewer at that step
    qtbot.waitUntil(lambda: row_of(w, 1).output_tokens == 4)
    assert rec.output_text.startswith(text_of(doc, OUTPUT))
    assert len(text_of(doc, OUTPUT)) < len(rec.output_text)
    assert text_of(doc, CACHED) == "".join(pieces[:cached])
    w.close()


def test_replay_without_text_shows_counts_blocks_and_a_note(qtbot, tmp_path, sessions):
    from kvscope.sessions import SessionReader

    w = replay_window(qtbot, tmp_path, sessions[False])
    w.replay_bar.set_step(w.source.step_range()[1])
    click_row(w, qtbot, 1)
    doc = w.text.view.document()
    with SessionReader(sessions[False]) as r:
        rec = r.request(1)
    assert NO_TEXT in text_of(doc, PLAIN)
    assert "Shared notes" not in doc.toPlainText()
    cached, n = rec.cached_tokens, rec.prompt_tokens
    # Each block as its token range, shaded as its tokens: the cached ones, then the rest.
    assert text_of(doc, CACHED).split() == [f"{i}–{i + BS - 1}" for i in range(0, cached, BS)]
    assert text_of(doc, COMPUTED).split()[-1] == f"{(n - 1) // BS * BS}–{n - 1}"
    assert f"{n:,} tokens" in w.text.title.text()
    assert len(w.text.view.ticks) == ticks_before(n + rec.output_tokens)
    w.close()
