"""The rows of the summary table, and running checks so that one broken check never hides
the others."""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field


@dataclass
class Row:
    section: str
    case: str
    ok: bool | None  # None: informational, or not measurable here (the CPU dry run)
    value: str
    target: str = ""
    data: dict = field(default_factory=dict)


class Report:
    def __init__(self, deadline: float):
        self.rows: list[Row] = []
        self.errors: list[dict] = []
        self.seconds: dict[str, float] = {}
        self.deadline = deadline

    def add(self, *args, **kwargs) -> None:
        self.rows.append(Row(*args, **kwargs))
        r = self.rows[-1]
        print(f"  {_mark(r.ok)} {r.section}: {r.case}: {r.value}", flush=True)

    def out_of_time(self, section: str, case: str) -> bool:
        if time.monotonic() < self.deadline:
            return False
        self.add(section, case, None, "skipped: time budget spent")
        return True

    def run(self, section: str, fn, *args) -> None:
        print(f"[{section}]", flush=True)
        t0 = time.monotonic()
        self.attempt(section, "section aborted", fn, self, *args)
        self.seconds[section] = round(time.monotonic() - t0, 1)

    def attempt(self, section: str, case: str, fn, *args) -> None:
        """Run ``fn(*args)``; an exception becomes a failed row: one broken check must not
        hide the others. The traceback goes to the JSON."""
        try:
            fn(*args)
        except Exception as e:
            line = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self.add(section, case, False, line[:200])
            self.errors.append({"section": section, "case": case,
                                "traceback": traceback.format_exc()})

    def table(self) -> str:
        cols = [("section", 10), ("case", 52), ("ok", 4), ("value", 52), ("target", 0)]
        lines = ["  ".join(name.ljust(w) for name, w in cols).rstrip()]
        for r in self.rows:
            cells = zip([r.section, r.case, _mark(r.ok), r.value, r.target], cols, strict=True)
            lines.append("  ".join(str(c).ljust(w) for c, (_, w) in cells).rstrip())
        return "\n".join(lines)

    @property
    def failed(self) -> bool:
        return any(r.ok is False for r in self.rows)


def _mark(ok: bool | None) -> str:
    return {True: "ok", False: "FAIL", None: "-"}[ok]

