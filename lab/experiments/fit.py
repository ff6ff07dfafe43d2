"""The arithmetic of the experiments: fits with R^2, ratios, "stable within 5 % of the median",
the warm-prefix ideal line. Pure Python (no torch, no Qt), tested on synthetic numbers."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Fit:
    """y = coef[0] + coef[1] x + coef[2] x^2 ... with its coefficient of determination."""

    coef: tuple[float, ...]
    r2: float

    def __call__(self, x: float) -> float:
        return sum(c * x**i for i, c in enumerate(self.coef))


def polyfit(xs: list[float], ys: list[float], degree: int) -> Fit:
    """Least squares by the normal equations (small degree, few points: exact enough)."""
    if len(xs) != len(ys) or len(xs) <= degree:
        raise ValueError(f"a degree-{degree} fit needs more than {degree} points, got {len(xs)}")
    n = degree + 1
    a = [[sum(x ** (i + j) for x in xs) for j in range(n)] for i in range(n)]
    b = [sum(y * x**i for x, y in zip(xs, ys, strict=True)) for i in range(n)]
    coef = _solve(a, b)
    fit = Fit(tuple(coef), 0.0)
    mean = statistics.fmean(ys)
    total = sum((y - mean) ** 2 for y in ys)
    resid = sum((y - fit(x)) ** 2 for x, y in zip(xs, ys, strict=True))
    return Fit(fit.coef, 1.0 - resid / total if total > 0 else 1.0)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; a singular system (all x equal) -> ValueError."""
    n = len(b)
    m = [row[:] + [v] for row, v in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12 * max(1.0, abs(m[col][col])):
            raise ValueError("the points do not determine a fit (too few distinct x)")
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    out = [0.0] * n
    for r in reversed(range(n)):
        out[r] = (m[r][n] - sum(m[r][c] * out[c] for c in range(r + 1, n))) / m[r][r]
    return out


def linear_fit(xs: list[float], ys: list[float]) -> Fit:
    return polyfit(xs, ys, 1)


def quadratic_fit(xs: list[float], ys: list[float]) -> Fit:
    return polyfit(xs, ys, 2)


def ratio(a: float, b: float) -> float:
    """a / b; inf when b is 0 and a is not."""
    if b == 0:
        return float("inf") if a else 1.0
    return a / b


def within(value: float, reference: float, tol: float) -> bool:
    return abs(value - reference) <= tol * abs(reference)


def spread(values: list[float]) -> float:
    """The largest deviation from the median, as a fraction of the median."""
    med = statistics.median(values)
    return max(abs(v - med) for v in values) / med if med else 0.0


def settled_after(values: list[float], tol: float = 0.05, run: int = 3) -> int | None:
    """How many values come before the first `run` consecutive ones within `tol` of the median
    of all of them (the steady state); None when that never happens."""
    med = statistics.median(values)
    for i in range(len(values) - run + 1):
        if all(within(v, med, tol) for v in values[i:i + run]):
            return i
    return None


def ideal_warm(cold: float, cached_fraction: float) -> float:
    """The textbook's ideal: a warm prefix removes its share of the cold time."""
    return cold * (1.0 - cached_fraction)


def blocks_per_request(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def requests_that_fit_in_blocks(num_blocks: int, tokens: int, block_size: int) -> int:
    """Whole requests of `tokens` tokens a pool of `num_blocks` holds at once (paged: each
    request rounds up to whole blocks)."""
    return num_blocks // blocks_per_request(tokens, block_size)
