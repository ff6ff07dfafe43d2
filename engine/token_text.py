"""Each token's own text: a prompt or an output cut at its token boundaries, so a view can shade
the tokens that came from the cache and mark where each block starts. Torch-free.

Decoding one token alone is wrong for byte-level and SentencePiece vocabularies (a character
split over two tokens, a leading space dropped at the start of a sequence), so each token's
piece is the difference between decoding a short window that ends with it and the same window
without it, as vLLM's incremental detokenizer does. A token that ends inside a character gets
an empty piece and the token that completes the character gets all of it: the pieces always
join to the decoded text, and there is exactly one per token."""

from __future__ import annotations

from itertools import accumulate


class TokenPieces:
    """The pieces of a growing token sequence (`extend` as tokens arrive)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.pieces: list[str] = []
        self._prefix = 0  # the window's context starts here ...
        self._read = 0  # ... and everything before this has its piece

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip) if ids else ""

    def extend(self, ids) -> list[str]:
        """Add tokens; returns their pieces (also appended to `pieces`)."""
        new = []
        for t in ids:
            self.ids.append(int(t))
            if self.tokenizer is None:  # token ids only: show the ids
                new.append(f"⟨{int(t)}⟩")
                continue
            before = self._decode(self.ids[self._prefix:self._read])
            text = self._decode(self.ids[self._prefix:])
            if len(text) > len(before) and not text.endswith("\ufffd"):
                new.append(text[len(before):])
                self._prefix, self._read = self._read, len(self.ids)
            else:  # a special token skipped, or a character not complete yet
                new.append("")
        self.pieces += new
        return new


def token_pieces(tokenizer, ids, skip_special_tokens: bool = True) -> list[str]:
    """One piece of text per token of `ids`; "".join(pieces) is the decoded text."""
    pieces = TokenPieces(tokenizer, skip_special_tokens)
    pieces.extend(ids)
    return pieces.pieces


def piece_ends(pieces: list[str]) -> list[int]:
    """Where each token's text ends in "".join(pieces) (characters), to store with the text."""
    return list(accumulate(map(len, pieces)))


def split_at(text: str, ends) -> list[str]:
    """The pieces again from the text and `piece_ends` (clipped to the text's length)."""
    out, start = [], 0
    for e in ends:
        e = max(start, min(int(e), len(text)))
        out.append(text[start:e])
        start = e
    return out


def first_stop(text: str, stops, start: int) -> int | None:
    """Where the earliest stop string in ``text`` begins, looking only at occurrences that end
    after ``start`` (the text before it has been searched already); None if none."""
    found = [i for s in stops if (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
    return min(found) if found else None
