"""The sections of scripts/gpu_check.py. Import after the entry point has set
``TRITON_INTERPRET`` (dry run) and made ``kvscope`` importable from the source tree."""
