"""Engine and sampling settings. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvscope.engine.block_pool import EVICTION_POLICIES


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: DEFAULT_CPU_BLOCKS on CPU, share of free memory on CUDA
    kv_cache_dtype: str = "auto"  # auto (model dtype) | float16 | bfloat16 | float32 | fp8
    enable_prefix_caching: bool = True
    enable_kv_cache: bool = True  # False: the naive loop that recomputes every sequence each step
    device: str = "cpu"  # cpu | cuda
    dtype: str | None = None  # model dtype; None: the checkpoint's (float32 on the CPU)
    max_num_batched_tokens: int = 1024  # token budget per step (prefill chunks + decodes)
    max_num_seqs: int = 64  # running requests at most
    warmup_steps: int = 2  # the first steps of a fresh engine are marked as warm-up
    gpu_memory_fraction: float = 0.5  # of free device memory given to the KV pool (CUDA)
    record_events: bool = True
    eviction_policy: str = "lru"  # which cached block is reused first: lru | fifo | lfu

    def __post_init__(self):
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name} must be positive")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError("EngineConfig.num_blocks must be positive")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"EngineConfig.eviction_policy must be one of "
                             f"{', '.join(EVICTION_POLICIES)}, got {self.eviction_policy!r}")


DEFAULT_CPU_BLOCKS = 2048


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1  # parallel samples sharing the prompt's blocks
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError("SamplingParams.max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("SamplingParams.temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("SamplingParams.top_p must be in (0, 1]")
        if self.top_k < 0 or self.n < 1:
            raise ValueError("SamplingParams.top_k must be >= 0 and n >= 1")
