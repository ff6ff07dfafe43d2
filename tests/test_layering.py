"""engine/, kernels/, lab/ and sessions/ never import Qt, pyqtgraph or the app, nor does the engine
process's entry module; opening a recording never needs torch. Checked by walking every import
statement in those files."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("PySide6", "pyqtgraph", "kvscope.app", "shiboken6")
TORCH_FREE = ["engine/__init__.py", "engine/block_hash.py", "engine/block_pool.py",
              "engine/events.py", "engine/explain.py", "engine/kv_cache_manager.py",
              "engine/snapshot.py", "engine/stream.py"]
INTERNALS = ("manager", "scheduler", "requests")  # the engine's: only engine/ may reach them


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def files(folder):
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("folder", ["engine", "kernels", "lab", "sessions"])
def test_core_folders_never_import_qt_or_the_app(folder):
    assert files(folder), f"{folder}/ has no Python files"
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in files(folder)
        for name in imported_modules(path)
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)
    ]
    assert not offenders, offenders


@pytest.mark.parametrize("folder", ["engine", "kernels", "lab"])
def test_the_layers_below_sessions_never_import_it(folder):
    """engine/ and kernels/ sit below lab/, which sits below sessions/ (and app/)."""
    above = ("kvscope.sessions", "kvscope.lab") if folder != "lab" else ("kvscope.sessions",)
    offenders = [f"{path.relative_to(ROOT)} imports {name}"
                 for path in files(folder) for name in imported_modules(path)
                 if any(name == a or name.startswith(a + ".") for a in above)]
    assert not offenders, offenders


def test_the_engine_process_entry_never_imports_qt():
    """app/host/server.py is the engine process's main module: it must not load Qt there."""
    bad = {m for m in imported_modules(ROOT / "app/host/server.py")
           if m.split(".")[0] in ("PySide6", "pyqtgraph", "shiboken6")}
    assert not bad, bad


@pytest.mark.parametrize("name", TORCH_FREE)
def test_snapshot_and_event_modules_are_torch_free(name):
    bad = {m for m in imported_modules(ROOT / name) if m.split(".")[0] in ("torch", "triton")}
    assert not bad, f"{name} imports {bad}"


def test_the_checker_sees_a_forbidden_import(tmp_path):
    """The walk finds imports nested in functions and from-imports."""
    sample = tmp_path / "m.py"
    sample.write_text("def f():\n    from PySide6.QtCore import QObject\n    import torch\n")
    assert {"PySide6.QtCore", "torch"} <= imported_modules(sample)


def engine_internals_used(path: Path, root: Path = ROOT) -> list[str]:
    """`engine.manager`, `self.engine.requests`, ...: attribute chains into an engine's
    internals."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in INTERNALS:
            base = node.value
            name = base.id if isinstance(base, ast.Name) else \
                base.attr if isinstance(base, ast.Attribute) else ""
            if name == "engine" or name.endswith("_engine"):
                found.append(f"{path.relative_to(root)}:{node.lineno} .{node.attr}")
    return found


def test_consumers_use_the_step_stream_and_the_public_api_only():
    """Outside the engine's own modules, nothing reaches into engine.manager, .scheduler or
    .requests: the recorder, the engine process, workloads, benchmarks and scripts consume the
    step stream and the public API."""
    own = {"engine.py", "scheduler.py", "kv_cache_manager.py"}
    paths = [p for folder in ("app", "sessions", "lab", "benchmarks", "scripts", "engine")
             for p in files(folder) if not (folder == "engine" and p.name in own)]
    offenders = [hit for p in paths for hit in engine_internals_used(p)]
    assert not offenders, offenders


def test_the_internals_check_sees_a_chain(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text("x = self.engine.manager.pool\ny = engine.requests[3]\nz = w.requests\n")
    assert engine_internals_used(sample, tmp_path) == ["m.py:1 .manager", "m.py:2 .requests"]


def test_every_package_folder_is_listed_for_installation():
    """A non-editable `pip install .` installs only the packages pyproject.toml lists."""
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = {
        name + "." + ".".join(init.parent.relative_to(ROOT / folder).parts)
        if init.parent != ROOT / folder else name
        for name, folder in tool["package-dir"].items()
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert found <= listed, sorted(found - listed)
