"""Each token's own text: the pieces join to the decoded text, one piece per token, also where
a character is split over several byte-level tokens."""

from __future__ import annotations

from pathlib import Path

from kvscope.engine.token_text import TokenPieces, piece_ends, split_at, token_pieces


def test_pieces_join_to_the_decoded_text_one_per_token():
    from kvscope.engine.models.load import _load_tokenizer

    tok = _load_tokenizer(Path(__file__).parents[2] / "resources" / "demo")
    text = "Hello wörld — naïve café 日本語!\n  two  spaces and 🙂 emoji"
    ids = tok.encode(text)
    pieces = token_pieces(tok, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text
    assert "" in pieces  # a split character: its first bytes' tokens have no text of their own
    assert all("\ufffd" not in p for p in pieces)
    grown = TokenPieces(tok)  # as an output grows, token by token: the same pieces
    for t in ids:
        grown.extend([t])
    assert grown.pieces == pieces
    assert split_at(text, piece_ends(pieces)) == pieces


def test_without_a_tokenizer_the_pieces_are_the_ids():
    assert token_pieces(None, [5, 17]) == ["⟨5⟩", "⟨17⟩"]
