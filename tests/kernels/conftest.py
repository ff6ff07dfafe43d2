import os

import torch

# The triton interpreter must be chosen before any @triton.jit runs; kvscope.kernels imports its
# triton modules lazily, so setting it here (before any test imports them) is enough.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
