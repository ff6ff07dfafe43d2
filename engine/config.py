"""Engine and sampling settings. Torch-free.

Both dataclasses check their fields on construction and raise ValueError with a one-line
message naming the field, so a bad value from a workload file, the command line or the API is
refused before a request is queued or a pool is allocated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from reprlib import Repr

from kvscope.engine import policies

# kvscope.engine.kv_format_spec describes each (FORMAT_NAMES: the same names)
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32", "fp8", "fp8_per_head",
                   "int8_per_token_head", "int4_per_token_head", "kivi4", "kivi2")
MODEL_DTYPES = ("float32", "float16", "bfloat16")
MIN_TEMPERATURE = 1e-6  # below this (but above 0) logits / temperature overflow float32
MAX_N = 256  # parallel samples per request
SEED_LIMIT = 2**64  # seeds are in [0, 2**64), torch.Generator's range


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """A finite int or float (not a bool)."""
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)


_repr = Repr()
_repr.maxlist = _repr.maxdict = 8
_repr.maxstring = _repr.maxlong = _repr.maxother = 50


def shown(value) -> str:
    """repr(value) cut short, for messages (a 10,000-id list, a 4,000-digit number)."""
    try:
        return _repr.repr(value)
    except ValueError:  # an int beyond Python's 4,300-digit conversion limit
        return f"an integer of {value.bit_length()} bits"


def check_text(value: str, what: str) -> None:
    """Refuse text that cannot be encoded as UTF-8 (a lone surrogate, e.g. from a JSON escape
    "\\ud800" or undecodable command-line bytes)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid text: a lone surrogate "
                         f"{shown(value[e.start])} at character {e.start}") from None


def why_not_text(value, what: str) -> str | None:
    """Why a str cannot be encoded (a lone surrogate, say), or None: the request is rejected
    with it, the rest are served."""
    try:
        if isinstance(value, str):
            check_text(value, what)
    except ValueError as e:
        return str(e)
    return None


def _int_at_least(owner: str, name: str, value, low: int) -> None:
    if not is_int(value):
        raise ValueError(f"{owner}.{name} must be an integer, got {shown(value)}")
    if value < low:
        raise ValueError(f"{owner}.{name} must be at least {low}, got {shown(value)}")


def _bools(owner: str, obj, names: tuple[str, ...]) -> None:
    for name in names:
        if not isinstance(getattr(obj, name), bool):
            raise ValueError(f"{owner}.{name} must be true or false, got "
                             f"{shown(getattr(obj, name))}")


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: DEFAULT_CPU_BLOCKS on CPU, share of free memory on CUDA
    kv_cache_dtype: str = "auto"  # auto (model dtype) | float16 | ... | kivi2: KV_CACHE_DTYPES
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
    # CPU float32 prefill: a second, oneDNN-blocked copy of each linear weight (made on first
    # use, beside the dense one the decode kernels read), for 1.1-1.7x faster prefill products.
    # Off by default: it adds about 0.8x the model's weight memory (425 MB on SmolLM2-135M).
    prepack_cpu_weights: bool = False
    # A host tier of this many blocks behind the pool (engine/host_tier.py: evicted blocks are
    # copied there, prefix hits found there are loaded back), or of as many blocks as fit in
    # host_bytes of host memory; 0: none. Its own eviction policy.
    host_blocks: int = 0
    host_bytes: int = 0
    host_eviction_policy: str = "lru"
    # fp8 caches (fp8, fp8_per_head): every layer's K and V scale (the stored value is x/scale;
    # 1.0 as vLLM without checkpoint scales), or "calibrate": from the prompts of the first
    # forward pass (2x their |K| and |V| maxima per layer, or per layer and KV head, map to 448)
    kv_scales: float | str = 1.0

    def __post_init__(self):
        own = "EngineConfig"
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            _int_at_least(own, name, getattr(self, name), 1)
        if self.num_blocks is not None:
            _int_at_least(own, "num_blocks", self.num_blocks, 1)
        _int_at_least(own, "warmup_steps", self.warmup_steps, 0)
        _int_at_least(own, "host_blocks", self.host_blocks, 0)
        _int_at_least(own, "host_bytes", self.host_bytes, 0)
        if self.host_blocks and self.host_bytes:
            raise ValueError(f"{own}: give host_blocks or host_bytes, not both")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"{own}.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)},"
                             f" got {shown(self.kv_cache_dtype)}")
        if self.kv_scales != "calibrate" and not (
                is_number(self.kv_scales) and 0 < self.kv_scales < math.inf):
            raise ValueError(f"{own}.kv_scales must be 'calibrate' or a positive finite number, "
                             f"got {shown(self.kv_scales)}")
        if self.kv_scales != 1.0 and self.kv_cache_dtype not in ("fp8", "fp8_per_head"):
            raise ValueError(f"{own}.kv_scales applies to fp8 caches only (kv_cache_dtype fp8 "
                             f"or fp8_per_head), not {self.kv_cache_dtype}")
        if self.dtype is not None and self.dtype not in MODEL_DTYPES:
            raise ValueError(f"{own}.dtype must be None or one of {', '.join(MODEL_DTYPES)}, "
                             f"got {shown(self.dtype)}")
        if not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"{own}.device must be 'cpu' or 'cuda', got {shown(self.device)}")
        if not (is_number(self.gpu_memory_fraction) and 0 < self.gpu_memory_fraction <= 1):
            raise ValueError(f"{own}.gpu_memory_fraction must be in (0, 1], got "
                             f"{shown(self.gpu_memory_fraction)}")
        _bools(own, self, ("enable_prefix_caching", "enable_kv_cache", "record_events",
                          "prepack_cpu_weights"))
        for name in ("eviction_policy", "host_eviction_policy"):
            if policies.check(getattr(self, name)):
                raise ValueError(f"{own}.{name} must be one of {', '.join(policies.names())}, "
                                 f"got {shown(getattr(self, name))}")
            if policies.POLICIES[getattr(self, name)].timed:  # (a replay could not redo it)
                raise ValueError(f"{own}.{name} {getattr(self, name)} needs a trace's clock: "
                                 "the lab replays it (kvscope lab TRACE --ttl S), not the engine")


DEFAULT_CPU_BLOCKS = 2048


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0: greedy; else at least MIN_TEMPERATURE
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None  # in [0, 2**64)
    n: int = 1  # parallel samples sharing the prompt's blocks, 1..MAX_N
    stop: list[str] = field(default_factory=list)  # a string is taken as a list of one
    ignore_eos: bool = False

    def __post_init__(self):
        own = "SamplingParams"
        _int_at_least(own, "max_tokens", self.max_tokens, 1)
        _int_at_least(own, "top_k", self.top_k, 0)
        _int_at_least(own, "n", self.n, 1)
        if self.n > MAX_N:
            raise ValueError(f"{own}.n must be at most {MAX_N}, got {self.n}")
        t = self.temperature
        if not is_number(t) or t < 0:
            raise ValueError(f"{own}.temperature must be a finite number >= 0, got {shown(t)}")
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"{own}.temperature must be 0 (greedy) or at least "
                             f"{MIN_TEMPERATURE:g}, got {shown(t)}")
        if not (is_number(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"{own}.top_p must be in (0, 1], got {shown(self.top_p)}")
        if self.seed is not None and not (is_int(self.seed) and 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"{own}.seed must be None or an integer in [0, 2**64), got "
                             f"{shown(self.seed)}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list | tuple):
            raise ValueError(f"{own}.stop must be a list of strings, got {shown(self.stop)}")
        self.stop = list(self.stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"{own}.stop must hold non-empty strings, got {shown(s)}")
            check_text(s, f"{own}.stop string")
        _bools(own, self, ("ignore_eos",))
