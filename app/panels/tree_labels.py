"""The prefix tree's labels (a mixin of PrefixTreePanel): which nodes get a label, in how many
words, and where one fits inside the view without covering another label or a node."""

from __future__ import annotations

import bisect
import itertools

import numpy as np
import pyqtgraph as pg
from PySide6.QtGui import QFontMetricsF, QTextDocument

from kvscope.app.prefix_tree import TreeNode

MAX_LABELS = 40
LABEL_MARGIN = 1  # px around a label's text


def requests_word(n: int) -> str:
    return f"{n} request{'s' if n != 1 else ''}"


def label_texts(node: TreeNode) -> list[str]:
    """A node's label, longest first (empty: no label): the run's length and the requests that
    hit it, then fewer words where the long one does not fit."""
    count = f"×{node.count}" if node.count > 1 else ""
    if not node.hits:
        return [count] if count else []
    hit = f"hit by {requests_word(node.hits)}"
    if count:
        return [f"{count} · {hit}", count]
    return [hit, f"hit by {node.hits}"]


def _covers(dots: tuple[list[float], float] | None, left: float, right: float) -> bool:
    """Whether a node of this row (sorted centres, radius) reaches into [left, right]."""
    if dots is None:
        return False
    centres, radius = dots
    i = bisect.bisect_left(centres, left - radius)
    return i < len(centres) and centres[i] < right + radius


def _free(left: float, right: float, room: tuple[float, float],
          labels: list[tuple[float, float]], dots: list) -> bool:
    """Whether a label over [left, right] (px) stays in its room and covers no label placed
    already and no node of the given rows."""
    if left < room[0] or right > room[1]:
        return False
    for a, b in labels:
        if a < right and left < b:
            return False
    return not any(_covers(d, left, right) for d in dots)


def label_text(node: TreeNode) -> str:
    texts = label_texts(node)
    return texts[0] if texts else ""


class TreeLabels:
    """The labels of a PrefixTreePanel (its `vb`, `plot`, `flat`, `_xs`, `_ys`, `_roots`,
    `_sizes`, `_slot_px` and `identities`)."""

    def _init_labels(self) -> None:
        self.labels: list[pg.TextItem] = []
        self._candidates: list[tuple[int, list[str], list[float]]] = []  # for labels
        self._texts: dict[tuple[int, int], tuple[list[str], list[float]]] = {}
        self._row_px = 0.0  # a label's height, measured with its width's slack by _measure
        self._metrics: QFontMetricsF | None = None
        self._slack = 0.0  # px a label's item adds to its text's advance
    def _label_px(self) -> float:
        """A label's height in px."""
        return self._row_px or QFontMetricsF(self.font()).height() + 2 * LABEL_MARGIN

    def _measure(self, text: str) -> float:
        """A label's width in px, as its text item draws it (the document's margins and a
        pixel of slack around the text's advance; a text document per label costs 20x more)."""
        if not self._row_px:
            doc = QTextDocument()
            doc.setDefaultFont(self.font())  # the labels' font: the application's
            doc.setDocumentMargin(LABEL_MARGIN)
            doc.setPlainText("×9")
            self._row_px = doc.size().height()
            self._metrics = QFontMetricsF(self.font())
            self._slack = doc.size().width() - self._metrics.horizontalAdvance("×9") + 1
        return self._metrics.horizontalAdvance(text) + self._slack

    def _label_candidates(self, flat: list[TreeNode]) -> list[tuple[int, list[str], list[float]]]:
        """(flat index, texts longest first, their widths in px) of the nodes worth a label,
        most telling first: the roots (their identity), the longest runs, then the most hits."""
        made = self._texts  # (blocks, hits) -> (texts, widths): most nodes share one
        out, order = [], []
        for i, n in enumerate(flat):
            if n.is_root:
                texts = self.identities.labels(n)
                label = (texts, [self._measure(t) for t in texts])
                rank = (0, 0, 0)
            elif n.count > 1 or n.hits:
                key = (n.count, n.hits)
                label = made.get(key)
                if label is None:
                    texts = label_texts(n)
                    label = made[key] = (texts, [self._measure(t) for t in texts])
                rank = (1, -n.count, -n.hits)
            else:
                continue
            out.append((i, *label))
            order.append(rank)
        out = [c for _, c in sorted(zip(order, out, strict=True), key=lambda p: p[0])]
        if len(made) > 10_000:
            made.clear()
        return out

    def _draw_labels(self) -> None:
        """Label the nodes that matter most where a label fits inside the view without covering
        another: right of its node, else left of it, else in fewer words; reuse the text items:
        creating them per frame costs more than the tree."""
        (x0, x1), (y0, y1) = self.vb.viewRange()
        width, height = self.vb.width(), self.vb.height()
        wanted = []
        if self._candidates and x1 > x0 and y1 > y0 and width > 0 and height > 0:
            sx, sy = width / (x1 - x0), height / (y1 - y0)
            row_px = self._label_px()
            gap = (self._sizes(self._slot_px or 1.0) / 2 + 3).tolist()  # px from the centre
            xs, ys = self._xs.tolist(), self._ys.tolist()
            rows: dict[int, list[tuple[float, float]]] = {}
            dots = self._dots_by_row(x0, y0, sx, sy, row_px)
            bounds = self._root_bounds(x0, sx, width)
            for i, texts, text_pxs in self._candidates:
                x, y = xs[i], ys[i]
                if not (x0 <= x <= x1 and y0 <= y <= y1):
                    continue
                cx, cy = (x - x0) * sx, (y - y0) * sy
                if cy - row_px / 2 < 0 or cy + row_px / 2 > height:
                    continue  # it would be cut at the top or the bottom
                row = int(cy // row_px)
                near = list(itertools.chain(rows.get(row - 1, ()), rows.get(row, ()),
                                            rows.get(row + 1, ())))
                room = bounds.get(i, (0.0, width))
                row_dots = [dots.get(r) for r in (row - 1, row, row + 1)]
                short = text_pxs[-1]
                if not (_free(cx + gap[i], cx + gap[i] + short, room, near, ())
                        or _free(cx - gap[i] - short, cx - gap[i], room, near, ())):
                    continue  # no room even for the fewest words (most nodes of a big tree)
                # Clear of every node if it can be; else the fewest words over small dots.
                tries = [(t, px, False) for t, px in zip(texts, text_pxs, strict=True)]
                for text, text_px, over_nodes in tries + [(texts[-1], short, True)]:
                    spot = next((left for left in (cx + gap[i], cx - gap[i] - text_px)
                                 if _free(left, left + text_px, room, near,
                                          [] if over_nodes else row_dots)), None)
                    if spot is not None:
                        rows.setdefault(row, []).append((spot, spot + text_px))
                        wanted.append((x0 + spot / sx, y, text))
                        break
                if len(wanted) == MAX_LABELS:
                    break
        while len(self.labels) < len(wanted):
            label = pg.TextItem("", color="#333333", anchor=(0, 0.5),
                                fill=pg.mkBrush(255, 255, 255, 190))
            label.textItem.document().setDocumentMargin(LABEL_MARGIN)
            self.plot.addItem(label, ignoreBounds=True)
            self.labels.append(label)
        for label, (x, y, text) in zip(self.labels, wanted, strict=False):
            if label.toPlainText() != text:
                label.setText(text)
            label.setPos(x, y)
            label.show()
        for label in self.labels[len(wanted):]:
            label.hide()

    def _root_bounds(self, x0: float, sx: float, width: float) -> dict[int, tuple[float, float]]:
        """Per root (flat index), the span (px) its label may take: up to halfway to the
        roots beside it, so that every root of a row gets a label, in fewer words if need be."""
        at = {i: (self._xs[i] - x0) * sx for i in self._roots}
        order = sorted(at, key=at.get)
        cuts = ([0.0] + [(at[a] + at[b]) / 2 for a, b in itertools.pairwise(order)] + [width])
        return {i: (max(0.0, cuts[k]), min(width, cuts[k + 1])) for k, i in enumerate(order)}

    def _dots_by_row(self, x0, y0, sx, sy, row_px) -> dict[int, tuple[list[float], float]]:
        """Per label row, the sorted x (px) of the nodes drawn in it and their largest radius:
        a label never covers a node."""
        if not len(self._xs):
            return {}
        px = (self._xs - x0) * sx
        row = ((self._ys - y0) * sy // row_px).astype(np.int64)
        radius = self._sizes(self._slot_px or 1.0) / 2 + 1
        order = np.lexsort((px, row))
        rows, starts = np.unique(row[order], return_index=True)
        bounds = np.append(starts, len(order)).tolist()
        px, radius = px[order].tolist(), radius[order]
        return {r: (px[a:b], float(radius[a:b].max()))
                for r, a, b in zip(rows.tolist(), bounds[:-1], bounds[1:], strict=True)}
