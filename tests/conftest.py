import gc
import os

import pytest

# Set before anything imports Qt or decorates triton kernels. The offscreen platform gets the
# screens of offscreen_screens.json: the primary one, large enough for every test's window, and a
# 1280x720 and a 1600x1000 one far off it, for the tests of a window that fits its screen.
if os.environ.setdefault("QT_QPA_PLATFORM", "offscreen") == "offscreen":
    os.environ["QT_QPA_PLATFORM"] = "offscreen:configfile=" + os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "offscreen_screens.json")
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover - torch is a dependency
    pass


def pytest_collection_finish(session):
    """What the test modules imported (torch, vLLM, Qt: over 600,000 objects) lives to the end:
    kept out of every later collection, which then looks only at what the tests made. A full
    collection took 0.5 s here; the Qt tests below run two each, and Python runs its own."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _collect_between_qt_tests(request):
    """No automatic garbage collection inside a Qt test; a collection after it instead. A
    collection that starts inside a Qt call (seen: inside QObject::disconnect, from pyqtgraph)
    can free an earlier test's widgets while Qt holds a signal lock their destructors need: the
    test process hangs for good (a CI run under pytest-xdist did)."""
    if "qtbot" not in request.fixturenames:
        yield
        return
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models gain nothing from threads, and the 2-core machines are shared: use one."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_model():
    """SmolLM2-135M-Instruct, loaded once per session (the wheel comes with scripts/setup.sh).
    Missing, it FAILS the tests that need it, with the pip command: never a silent skip."""
    from kvscope.engine.models.load import ModelLoadError, load_model

    try:
        return load_model("smollm2")
    except ModelLoadError as e:
        pytest.fail(f"SmolLM2 is needed here: {e}")
