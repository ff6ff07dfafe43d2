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
    # One CPU thread per test process (the workers share the cores), from the start: session and
    # module fixtures run before _one_torch_thread (transformers' SmolLM2 reference ran on two).
    torch.set_num_threads(1)
except ImportError:  # pragma: no cover - torch is a dependency
    pass


# Under pytest-xdist (README: -n auto) each group's tests run on one worker, which pays their
# costly setup once: importing vLLM (10 s: conformance/vllm_ref.py), SmolLM2 with
# transformers' reference run of it (20 s: the smollm2_model fixture), and the cache state
# machine's run that test_enough_operations_ran counts (10 s). (pytest-xdist's own
# xdist_group marks never reach its scheduler under pytest 9: xdist renames the item's _nodeid,
# which pytest 9 no longer reads.)
SHARED_SETUP = {"tests/conformance/": "vllm", "tests/models/test_smollm2.py": "smollm2",
                "tests/models/test_gguf_loader.py": "smollm2",
                "tests/engine/test_chat_workload.py": "smollm2",
                "tests/engine/test_kv_cache_stateful.py": "hypothesis"}


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # (a hook of pytest-xdist's: -p no:xdist)
def pytest_xdist_make_scheduler(config, log):
    """xdist's default (--dist load: each test to whichever worker is free) with the groups
    above as one unit each, handed out first (the largest units first)."""
    if config.getvalue("dist") != "load":
        return None  # a --dist the user chose
    from xdist.scheduler import LoadScopeScheduling

    class SharedSetupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return next((group for prefix, group in SHARED_SETUP.items()
                         if nodeid.startswith(prefix)), nodeid)

    return SharedSetupScheduling(config, log)


def pytest_collection_modifyitems(items):
    """The files with a slow test first (whole: their module fixtures are made once): started
    last, a slow test would leave the other workers idle at the end."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


def pytest_collection_finish(session):
    """What the test modules imported (torch, transformers, Qt: hundreds of thousands of
    objects) lives to the end: kept out of every later collection, which then looks only at what
    the tests made. A full collection took 0.2-0.5 s here; each Qt test runs two (below), Python
    runs its own."""
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
