"""Helpers for tests/hostile (a uniquely named module, not conftest)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under a folder (to show an input was left untouched)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_one_line_error(result: tuple[int, str, str], *words: str) -> str:
    code, _, err = result
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1, err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def write_jsonl(path: Path, *rows) -> Path:
    """Rows are dicts (dumped as JSON) or raw strings (written as they are)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows),
                    encoding="utf-8")
    return path
