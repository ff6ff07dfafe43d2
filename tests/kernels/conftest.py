import os
import sys
from pathlib import Path

import torch

# scripts/gpucheck/kv_passes.py: the passes the triton format tests share with gpu_check.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

# The triton interpreter must be chosen before any @triton.jit runs; kvscope.kernels imports its
# triton modules lazily, so setting it here (before any test imports them) is enough.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
