"""What an experiment hands back: the claim, a table of named numbers, what to plot, and the
verdict line. Torch-free, so the window and the session reader use it without the engine."""

from __future__ import annotations

import csv
import io
from dataclasses import asdict, dataclass, field


@dataclass
class Result:
    name: str
    claim: str
    columns: list[str]
    rows: list[list[float | int | str]]
    verdict: str
    x: str = ""  # the column on the plot's x axis
    ys: list[str] = field(default_factory=list)  # the columns drawn against it
    model: str = ""

    def column(self, name: str) -> list:
        i = self.columns.index(name)
        return [row[i] for row in self.rows]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Result:
        return cls(**d)

    def to_csv(self) -> str:
        out = io.StringIO()
        w = csv.writer(out, lineterminator="\n")
        w.writerow(self.columns)
        w.writerows(self.rows)
        return out.getvalue()

    def table(self) -> str:
        """The rows as aligned text, numbers to 4 significant digits."""
        cells = [self.columns] + [[cell(v) for v in row] for row in self.rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(self.columns))]
        return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True))
                         for r in cells)


def cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


class Cancelled(Exception):
    """The user cancelled a running experiment."""


@dataclass
class Control:
    """How a measurement reports progress and learns it was cancelled."""

    progress: object = None  # progress(fraction in [0, 1], text) or None
    cancel: object = None  # cancel() -> bool, e.g. threading.Event().is_set, or None

    def tick(self, done: float, total: float, text: str = "") -> None:
        if self.cancel is not None and self.cancel():
            raise Cancelled("cancelled")
        if self.progress is not None:
            self.progress(min(1.0, done / total) if total else 1.0, text)
