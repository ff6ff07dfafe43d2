"""No import cycle between any two modules of the package, lazy imports inside functions
included (a lazy back-import is how a cycle hides): each module's imports are read from its
source, resolved to package modules, and the graph is searched for strongly connected parts.
Imports under `if TYPE_CHECKING:` do not run and do not count."""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def package_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every folder pyproject.toml maps to a package."""
    dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    mods = {}
    for pkg, folder in dirs.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = [pkg, *path.relative_to(root / folder).with_suffix("").parts]
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _skipped(tree) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    skip, found = _skipped(tree), set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: None if path.name == "__init__.py" else -1]
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module
            for a in node.names:  # `from pkg import submodule` imports the submodule
                found.add(f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module)
    edges = set()
    for m in found:
        while m and m not in mods:
            m = m.rpartition(".")[0]
        if m and m != name:
            edges.add(m)
    return edges


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                part = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    part.append(w)
                    if w == v:
                        break
                if len(part) > 1:
                    out.append(sorted(part))
    return out


def test_no_module_imports_itself_through_others():
    mods = package_modules(ROOT)
    assert len(mods) > 100
    graph = {m: imports_of(m, p, mods) for m, p in mods.items()}
    assert not cycles(graph)


def test_the_checker_finds_a_lazy_cycle(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import f\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from pkg import a\n")
    (tmp_path / "pkg" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"pkg" = "pkg"\n')
    mods = package_modules(tmp_path)
    graph = {m: imports_of(m, p, mods) for m, p in mods.items()}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
    assert graph["pkg.c"] == set()
