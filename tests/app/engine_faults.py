"""Run first by the engine process in the tests that ask for it
(``MainWindow(engine_setup=<this file>)``): while the file named by $KVSCOPE_TEST_FAULT
exists, every forward pass of the real engine raises."""

import os
from pathlib import Path

from kvscope.engine.model_runner import ModelRunner

_real_run = ModelRunner.run


def _run(self, *args, **kwargs):
    flag = os.environ.get("KVSCOPE_TEST_FAULT")
    if flag and Path(flag).exists():
        raise RuntimeError("simulated kernel failure")
    return _real_run(self, *args, **kwargs)


ModelRunner.run = _run
