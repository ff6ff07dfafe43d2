"""The timeline's curves reduced to what a pixel can show: at several samples per pixel, the
max and min of the samples under each pixel (an envelope), or a bar per pixel under a filled
curve; on the wall-clock axis each step spans the time it ran."""

from __future__ import annotations

import numpy as np


def _runs(y: np.ndarray, n: int) -> tuple[int, np.ndarray, np.ndarray]:
    """The max and the min of each run of n samples, the last sample of the run before and the
    first of the run after included (the line from a neighbour crosses into the run's pixel:
    without them, runs shorter than the data's period leave gaps), and where the runs end.
    The last sample is never in a run: a curve ends on it."""
    runs = (len(y) - 1) // n
    end = runs * n
    block = y[:end].reshape(runs, n)
    hi, lo = block.max(axis=1), block.min(axis=1)
    after = y[n : end + 1 : n]  # the first sample after each run
    hi, lo = np.maximum(hi, after), np.minimum(lo, after)
    before = y[n - 1 : end - 1 : n]  # the last sample before each run but the first
    hi[1:], lo[1:] = np.maximum(hi[1:], before), np.minimum(lo[1:], before)
    return end, hi, lo


def _columns(x: np.ndarray, y: np.ndarray, width: int) -> tuple[np.ndarray, ...]:
    """For x that is not evenly spaced (seconds): x[0]..x[-1] cut into `width` equal columns;
    each column's left edge, and the max and min of the line through every sample inside it:
    its samples, and the line's values where it enters and leaves the column (a neighbour
    pixels away does not count, as a neighbour does in _runs; a column with no sample gets the
    line crossing it)."""
    edges = np.linspace(x[0], x[-1], width + 1)
    at_edges = np.interp(edges, x, y)
    hi = np.maximum(at_edges[:-1], at_edges[1:])
    lo = np.minimum(at_edges[:-1], at_edges[1:])
    idx = np.searchsorted(x, edges)
    idx[-1] = len(x) - 1  # the last sample is in no column: a curve ends on it
    full = idx[1:] > idx[:-1]
    if full.any():
        inner, starts = y[: len(x) - 1], idx[:-1][full]
        hi[full] = np.maximum(hi[full], np.maximum.reduceat(inner, starts))
        lo[full] = np.minimum(lo[full], np.minimum.reduceat(inner, starts))
    return edges[:-1], hi, lo


def _envelope(x, y, n: int, width: int | None):
    """(x of each run, its max, its min, x and y of the samples after the runs): runs of n
    samples (x evenly spaced, width None) or pixel columns (see _columns)."""
    if width is None:
        end, hi, lo = _runs(y, n)
        return x[:end:n], hi, lo, x[end:], y[end:]
    left, hi, lo = _columns(x, y, width)
    return left, hi, lo, x[-1:], y[-1:]


def _spans(x: np.ndarray, stop: np.ndarray, y: np.ndarray, box: bool):
    """Each step drawn over the time it ran, from its start x to its stop: a box from 0 (box)
    or a flat line (a staircase through the steps)."""
    if box:
        ys = np.zeros((len(y), 4))
        ys[:, 1] = ys[:, 2] = y
        return np.column_stack([x, x, stop, stop]).ravel(), ys.ravel()
    return np.column_stack([x, stop]).ravel(), np.repeat(y, 2)


def _peaks(x: np.ndarray, y: np.ndarray, n: int,
           width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The max and the min of each run of n samples (at the run's first x), then the last
    samples as they are: at n samples per pixel, the envelope of the line through them all.
    With width, runs are pixel columns instead (x in seconds, see _columns)."""
    if n <= 1 and width is None:
        return x, y
    xs, hi, lo, tx, ty = _envelope(x, y, n, width)
    runs = len(hi)
    px = np.empty(2 * runs + len(tx))
    py = np.empty_like(px)
    px[: 2 * runs : 2] = px[1 : 2 * runs : 2] = xs
    py[: 2 * runs : 2], py[1 : 2 * runs : 2] = hi, lo
    px[2 * runs :], py[2 * runs :] = tx, ty
    return px, py


def _bars(x: np.ndarray, y: np.ndarray, n: int,
          width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Vertical segments from 0 to the max of each run of n samples (or pixel column, with
    width), for a line item drawing pairs: at a run or more per pixel they fill the area under
    the curve, for a fraction of the cost of filling a path."""
    xs, hi, _, tx, ty = _envelope(x, y, n, width)
    tops = np.concatenate([hi, ty])
    xs = np.concatenate([xs, tx])
    bx, by = np.repeat(xs, 2), np.zeros(2 * len(tops))
    by[1::2] = tops
    return bx, by
