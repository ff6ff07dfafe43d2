import os

# Set before anything imports Qt or decorates triton kernels.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover - torch is a dependency
    pass
