"""C kernels for float32 decode steps on the CPU (``cpu_kernels.c``), called through ctypes.

A decode step is a chain of matrix-vector products plus ~70 small ops per layer. torch's CPU
``linear`` goes to MKL, which on this project's AMD machines streams the weights of a one-row
product at about 0.35 of the memory read bandwidth; the C kernel streams each weight row once and
reaches about 0.8. The small-op chains (RMSNorm, rotary, SiLU-and-multiply, the KV store,
paged decode attention) each become one call, and a whole decode step's decoder layers one call
in all (``DecoderWeights``). Prefill attention uses torch's fused attention
(``prefill_attention``).

The library is compiled on first use with the system C compiler (as triton compiles its
launchers), cached by source hash under ``~/.cache/kvscope``. Without a compiler, or with
``KVSCOPE_CPU_KERNELS=0``, every C-backed function here returns None (or False) and callers use
torch (``prefill_attention`` is torch's own and runs either way); that setting also keeps the
weights where torch put them (``hugepage_weights``), so it gives the plain-torch engine for
comparisons.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import mmap
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from kvscope.kernels import reference

log = logging.getLogger(__name__)

# Token rows up to which the C kernels replace torch's small ops, and up to which a decode
# step runs in one C call (DecoderWeights: its products included, even with torch's at 16 rows,
# and no per-op Python calls: on a small model those are most of a step).
MAX_ROWS = 16
# The linear kernel reads each weight once for all rows but is not a blocked GEMM: measured on
# the SmolLM2 shapes here (the 30 layers' products, weights from memory, one thread), 0.6x
# torch's time at 8 rows, 0.76x at 12, even at 16, 1.14x at 20. Alone, it takes up to 12.
LINEAR_MAX_ROWS = 12
_SOURCES = [Path(__file__).with_name(n) for n in ("cpu_kernels.c", "cpu_kv_formats.c")]
_HEADER = Path(__file__).with_name("cpu_simd.h")
_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared"]
_lib: ctypes.CDLL | None | bool = False  # False: not tried yet; None: unavailable


def cache_dir() -> Path:
    """kvscope's cache folder (``$XDG_CACHE_HOME/kvscope``, else ``~/.cache/kvscope``)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "kvscope"


def _compile(sources: list[Path], target: Path) -> bool:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    for extra in (["-fopenmp"], []):  # OpenMP when the compiler has it
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run([cc, *_FLAGS, *extra, *map(str, sources), "-o", tmp, "-lm"],
                                  capture_output=True, timeout=60)
            if done.returncode == 0:
                os.replace(tmp, target)  # atomic: a parallel process sees all or nothing
                return True
            log.debug("cc failed: %s", done.stderr.decode(errors="replace"))
        except (OSError, subprocess.SubprocessError) as e:
            log.debug("cc failed: %s", e)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return False


def enabled() -> bool:
    return os.environ.get("KVSCOPE_CPU_KERNELS", "1") != "0"


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, built on first use; None where it cannot be built."""
    global _lib
    if _lib is not False:
        return _lib
    _lib = None
    if not enabled():
        return None
    try:
        source = b"".join(p.read_bytes() for p in (*_SOURCES, _HEADER))
        key = hashlib.sha256(source + " ".join(_FLAGS).encode()
                             + platform.node().encode() + os.uname().machine.encode())
        target = cache_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"
        if not target.exists() and not _compile(_SOURCES, target):
            log.info("no C compiler for kvscope's CPU kernels: using torch's ops")
            return None
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        log.info("kvscope's CPU kernels are unavailable (%s): using torch's ops", e)
        return None
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = args
    _lib = lib
    return lib


_P, _I, _F, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "kv_linear_f32": [_P, _I, _P, _P, _P, _I, _I, _I, _N],
    "kv_rms_norm_f32": [_P, _P, _P, _I, _I, _F],
    "kv_rope_f32": [_P, _I, _I, _I, _P, _P],
    "kv_silu_mul_f32": [_P, _P, _P, _I],
    "kv_store_f32": [_P, _P, _P, _P, _P, _I, _I, _I],
    "kv_decode_attention_f32": [_P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _F,
                                _N],
    "kv_decode_layers_f32": [_P, _I, _P, _P, _I, _I, _I, _I, _I, _I, _F, _F, _P, _P, _P, _P, _I,
                             _P, _I, _I, _P, _N],
    "kv_decode_attention_packed": [_P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _F, _N],
}


def _f32(*tensors: torch.Tensor | None) -> bool:
    """All given tensors are contiguous float32 CPU tensors, and no gradient is wanted.
    (A plain loop: this runs ~400 times per decode step.)"""
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu"
                              or not t.is_contiguous() or (grad and t.requires_grad)):
            return False
    return True


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` for ``x`` ``[M <= LINEAR_MAX_ROWS, K]``; None when not
    applicable (other dtypes or devices, more rows, autograd, no compiler)."""
    if (x.dim() != 2 or x.shape[0] > LINEAR_MAX_ROWS or weight.dim() != 2
            or weight.shape[1] != x.shape[1] or not _f32(x, weight, bias)):
        return None
    lib = load()
    if lib is None:
        return None
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    lib.kv_linear_f32(x.data_ptr(), k, weight.data_ptr(),
                      bias.data_ptr() if bias is not None else None, out.data_ptr(),
                      m, k, n, torch.get_num_threads())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim; None when not applicable."""
    if not _f32(x, weight) or weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        return None
    lib = load()
    if lib is None:
        return None
    out = torch.empty_like(x)
    d = weight.shape[0]
    lib.kv_rms_norm_f32(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // d, d, eps)
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate ``x`` ``[T, heads, D]`` in place with ``cos``/``sin`` ``[T, 1, D]``; False (and
    ``x`` untouched) when not applicable."""
    if (not _f32(x, cos, sin) or x.dim() != 3 or cos.shape != (x.shape[0], 1, x.shape[2])
            or sin.shape != cos.shape or x.shape[2] % 2):
        return False
    lib = load()
    if lib is None:
        return False
    t, heads, d = x.shape
    lib.kv_rope_f32(x.data_ptr(), t, heads, d, cos.data_ptr(), sin.data_ptr())
    return True


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up``; None when not applicable."""
    if not _f32(gate, up) or gate.shape != up.shape:
        return None
    lib = load()
    if lib is None:
        return None
    out = torch.empty_like(gate)
    lib.kv_silu_mul_f32(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
    return out


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> bool:
    """The reference ``store_kv`` for float32 caches without scales; False when not applicable."""
    if (not _f32(key, value, k_cache, v_cache) or slot_mapping.dtype != torch.int64
            or not slot_mapping.is_contiguous() or key.shape != value.shape
            or key.shape[1:] != k_cache.shape[2:] or k_cache.shape != v_cache.shape
            or slot_mapping.shape != key.shape[:1]):
        return False
    lib = load()
    if lib is None:
        return False
    row = k_cache.shape[2] * k_cache.shape[3]
    if lib.kv_store_f32(key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                        slot_mapping.data_ptr(), key.shape[0], row,
                        k_cache.shape[0] * k_cache.shape[1]) != 0:
        raise IndexError("store_kv: slot out of range")
    return True


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                     max_seqlen_k, window=None, softcap=None) -> torch.Tensor | None:
    """The reference ``paged_decode_attention`` for float32 caches without scales, reading the
    pool in place (within a sliding ``window``, only the blocks it covers; scores soft-capped
    by ``softcap``); None when not applicable."""
    if (not _f32(q, k_cache, v_cache) or q.dim() != 3 or k_cache.dim() != 4
            or block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32
            or not block_tables.is_contiguous() or not context_lens.is_contiguous()
            or q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]
            or block_tables.shape[0] != q.shape[0] or context_lens.shape != q.shape[:1]):
        return None
    lib = load()
    if lib is None:
        return None
    batch, heads, d = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    status = lib.kv_decode_attention_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0) if batch else 0, context_lens.data_ptr(), out.data_ptr(), batch,
        heads, kv_heads, d, block_size, k_cache.shape[0], window or 0, scale, softcap or 0.0,
        torch.get_num_threads())
    _check(status, "decode attention: no memory for the score rows")
    return out


def _check(status: int, out_of_memory: str) -> None:
    """Raise for a kernel's error status (the codes of cpu_kernels.c and cpu_kv_formats.c)."""
    if status == -4:
        raise IndexError("decode attention: a KIVI residual row outside the residual")
    if status == -3:
        raise IndexError("store_kv: slot out of range")
    if status == -2:
        raise IndexError("decode attention: a block table is too short or names a block "
                         "outside the pool")
    if status != 0:
        raise MemoryError(out_of_memory)


MASK_ENTRIES = 1 << 24


def prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                      k_scale=1.0, v_scale=1.0, max_seqlen_q=None, window=None,
                      softcap=None) -> torch.Tensor:
    """The reference ``paged_prefill_attention`` with torch's fused attention
    (``scaled_dot_product_attention``, its CPU flash kernel) in place of explicit score and
    softmax tensors: 4x faster from a few hundred tokens on (SmolLM2's shapes, one thread), and
    without a prefix the causal mask lets it skip the upper triangle. Any cache dtype (fp8 read
    back through its scale); computed in float32 like the reference. ``max_seqlen_q`` is
    unused (the lengths are walked on the host anyway). ``window``: a sliding-window layer's W
    (keys before a chunk's window are not read). ``softcap``: explicit scores
    (``reference.attention``)."""
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for b, ctx in enumerate(context_lens.tolist()):
        start, q_len = cu[b], cu[b + 1] - cu[b]
        if q_len == 0:
            continue
        # [1, heads, tokens, D]: without the batch dim torch takes its unfused math path.
        k = reference.gather_kv(k_cache, block_tables[b], ctx, k_scale, b).transpose(0, 1)[None]
        v = reference.gather_kv(v_cache, block_tables[b], ctx, v_scale, b).transpose(0, 1)[None]
        past = ctx - q_len  # keys before the first new token (a prefix-cache hit, or chunks)
        causal_only = past == 0 and (window is None or window >= q_len) and not softcap
        # Query rows per call: the boolean mask of a prefix hit stays under MASK_ENTRIES.
        rows = q_len if causal_only else max(1, MASK_ENTRIES // ctx)
        for i in range(0, q_len, rows):
            j = min(q_len, i + rows)
            n = past + j  # keys after the chunk's last query are masked for every row: drop
            lo = 0 if window is None else max(0, past + i - window + 1)  # before every window
            qs = q[start + i:start + j].float().transpose(0, 1)[None]
            if causal_only and i == 0 and j == q_len:
                o = F.scaled_dot_product_attention(qs, k[:, :, :n], v[:, :, :n], is_causal=True,
                                                   scale=scale, enable_gqa=True)
            else:
                keys = torch.arange(lo, n, device=q.device)[None, :]
                pos = torch.arange(past + i, past + j, device=q.device)[:, None]
                mask = keys <= pos
                if window is not None:
                    mask &= keys > pos - window
                o = reference.attention(qs, k[:, :, lo:n], v[:, :, lo:n], mask, scale, softcap)
            out[start + i:start + j] = o[0].transpose(0, 1).to(q.dtype)
    return out


# The fields of kv_layer_f32 (cpu_kernels.c), in order: one decoder layer's weights.
LAYER_FIELDS = ("ln1", "wq", "bq", "wk", "bk", "wv", "bv", "q_norm", "k_norm", "wo", "bo",
                "ln2", "wg", "bg", "wu", "bu", "wd", "bd")
_OPTIONAL = {"bq", "bk", "bv", "q_norm", "k_norm", "bo", "bg", "bu", "bd"}


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in LAYER_FIELDS]


class DecoderWeights:
    """A model's decoder layers as ``kv_decode_layers_f32`` reads them: every layer of a decode
    step in one C call (the per-op path costs ~400 Python-level calls a step, ~5 ms on
    SmolLM2). ``layers``: one dict per layer, ``LAYER_FIELDS`` -> tensor (None for an absent
    bias or norm). ``usable`` is False when a weight is not a contiguous float32 CPU tensor of
    the shape the dimensions give (then callers take the per-op path). ``windows``: each
    layer's sliding window (None: full attention); None: no layer has one."""

    def __init__(self, layers: list[dict[str, torch.Tensor | None]], hidden: int, heads: int,
                 kv_heads: int, head_dim: int, intermediate: int, eps: float, scale: float,
                 windows: list[int | None] | None = None):
        self.dims = (hidden, heads, kv_heads, head_dim, intermediate)
        self.eps, self.scale = eps, scale
        self._windows = None  # int64 per layer for the C call, 0: full attention
        if windows is not None and any(windows):
            self._windows = torch.tensor([w or 0 for w in windows], dtype=torch.int64)
        self._tensors = [t for layer in layers for t in layer.values() if t is not None]
        self._key = self.key()
        qw, kvw = heads * head_dim, kv_heads * head_dim
        shapes = {"ln1": (hidden,), "wq": (qw, hidden), "bq": (qw,), "wk": (kvw, hidden),
                  "bk": (kvw,), "wv": (kvw, hidden), "bv": (kvw,), "q_norm": (head_dim,),
                  "k_norm": (head_dim,), "wo": (hidden, qw), "bo": (hidden,), "ln2": (hidden,),
                  "wg": (intermediate, hidden), "bg": (intermediate,),
                  "wu": (intermediate, hidden), "bu": (intermediate,),
                  "wd": (hidden, intermediate), "bd": (hidden,)}
        def fits(layer) -> bool:
            return (all(tuple(t.shape) == shapes[name] if t is not None else name in _OPTIONAL
                        for name, t in ((n, layer.get(n)) for n in LAYER_FIELDS))
                    and (layer.get("q_norm") is None) == (layer.get("k_norm") is None))

        self.usable = bool(layers) and _f32(*self._tensors) and all(map(fits, layers))
        self._array = (_Layer * len(layers))()
        if self.usable:
            for row, layer in zip(self._array, layers, strict=True):
                for name, t in layer.items():
                    setattr(row, name, t.data_ptr() if t is not None else None)
        self.num_layers = len(layers)

    def key(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self._tensors)

    def current(self) -> bool:
        """The weights still live where they did when this was built (``hugepage_weights`` or
        ``p.data = ...`` move them)."""
        return self.key() == self._key

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
            slot_mapping: torch.Tensor, block_tables: torch.Tensor,
            context_lens: torch.Tensor) -> bool:
        """Every decoder layer of a decode step, ``x`` ``[B, hidden]`` updated in place (one
        token per sequence, rotary ``cos``/``sin`` ``[B, 1, head_dim]``, a float32 ``kv_cache``
        ``[layers, 2, blocks, block_size, kv_heads, head_dim]``); False (nothing done) when not
        applicable."""
        hidden, heads, kv_heads, head_dim, inter = self.dims
        batch = x.shape[0] if x.dim() == 2 else 0
        if (not self.usable or not 0 < batch <= MAX_ROWS or x.shape[1] != hidden
                or not _f32(x, cos, sin, kv_cache) or cos.shape != (batch, 1, head_dim)
                or sin.shape != cos.shape or kv_cache.dim() != 6
                or kv_cache.shape[0] != self.num_layers or kv_cache.shape[1] != 2
                or kv_cache.shape[4:] != (kv_heads, head_dim)
                or slot_mapping.dtype != torch.int64 or slot_mapping.shape != (batch,)
                or block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32
                or block_tables.dim() != 2 or block_tables.shape[0] != batch
                or context_lens.shape != (batch,) or not slot_mapping.is_contiguous()
                or not block_tables.is_contiguous() or not context_lens.is_contiguous()):
            return False
        lib = load()
        if lib is None:
            return False
        num_blocks, block_size = kv_cache.shape[2], kv_cache.shape[3]
        status = lib.kv_decode_layers_f32(
            self._array, self.num_layers, kv_cache.data_ptr(), x.data_ptr(), batch, hidden,
            heads, kv_heads, head_dim, inter, self.eps, self.scale, cos.data_ptr(),
            sin.data_ptr(), slot_mapping.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), context_lens.data_ptr(), block_size, num_blocks,
            None if self._windows is None else self._windows.data_ptr(), torch.get_num_threads())
        _check(status, "decode step: no memory for the layer buffers")
        return True


# Prefill-sized products (more rows than LINEAR_MAX_ROWS) on oneDNN with the weight reordered
# once into its blocked layout: on the SmolLM2 shapes at 13..2048 rows, one thread, 1.1-1.7x
# MKL's F.linear (median about 1.3x; the row-count hint of the reorder makes no measurable
# difference, so one copy serves every size). The price is a second copy of each weight beside
# the dense one the decode kernel reads: opt-in (EngineConfig.prepack_cpu_weights).
_PACK_ATTR = "_kvscope_packed"  # (weight data_ptr, version, shape) -> the reordered copy
_packing: bool | None = None  # None: not tried yet


def _packing_available() -> bool:
    global _packing
    if _packing is None:
        ops = getattr(torch.ops, "mkldnn", None)
        try:
            _packing = bool(torch.backends.mkldnn.is_available()
                            and hasattr(ops, "_reorder_linear_weight")
                            and hasattr(ops, "_linear_pointwise"))
        except (AttributeError, RuntimeError):
            _packing = False
    return _packing


def packed_linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """``F.linear(x, module.weight, module.bias)`` for float32 CPU ``x`` ``[M > LINEAR_MAX_ROWS,
    K]`` through oneDNN with a reordered copy of the weight, made on the first call and kept on
    the module (remade when the weight is replaced or changed in place); None when not
    applicable (fewer rows, other dtypes or devices, autograd, ``KVSCOPE_CPU_KERNELS=0``, no
    oneDNN in this torch build)."""
    weight, bias = module.weight, module.bias
    if (x.dim() != 2 or x.shape[0] <= LINEAR_MAX_ROWS or weight.dim() != 2
            or weight.shape[1] != x.shape[1] or not _f32(x, weight, bias)
            or not enabled() or not _packing_available()):
        return None
    key = (weight.data_ptr(), weight._version, tuple(weight.shape))
    cached = module.__dict__.get(_PACK_ATTR)
    if cached is None or cached[0] != key:
        global _packing
        try:
            with torch.inference_mode(False), torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        except RuntimeError as e:  # an op this build registers but cannot run
            log.info("no oneDNN weight packing (%s): using torch's linear", e)
            _packing = False
            return None
        module.__dict__[_PACK_ATTR] = cached = (key, packed)
    return torch.ops.mkldnn._linear_pointwise(x, cached[1], bias, "none", [], "")


def drop_packed(module: torch.nn.Module) -> None:
    """Free the reordered weight copies held under ``module``."""
    for m in module.modules():
        m.__dict__.pop(_PACK_ATTR, None)


def packed_bytes(module: torch.nn.Module) -> int:
    """Bytes of the reordered weight copies ``packed_linear`` holds under ``module`` (the
    blocked copy has as many elements as the weight)."""
    total = 0
    for m in module.modules():
        if (cached := m.__dict__.get(_PACK_ATTR)) is not None:
            total += cached[1].numel() * cached[1].element_size()
    return total


HUGE_PAGE = 2 << 20


def hugepage_weights(module: torch.nn.Module) -> int:
    """Move the module's CPU parameters into one anonymous mapping backed by transparent huge
    pages (Linux, ``madvise`` mode); returns the bytes moved (0 where not possible).

    A decode step streams every weight from memory once. On 4 KiB pages the hardware prefetcher
    stops at every page boundary and each page costs a TLB walk: the same kernel reads ~30 %
    faster from 2 MiB pages (torch's allocator only asks for them with
    ``THP_MEM_ALLOC_ENABLE=1`` set before start-up)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    params, seen = [], set()
    for p in module.parameters():
        if id(p) not in seen and p.device.type == "cpu" and p.is_contiguous():
            seen.add(id(p))
            params.append(p)
    if advice is None or not params or not enabled():
        return 0
    sizes = [-(-p.numel() * p.element_size() // 64) * 64 for p in params]
    try:
        arena = mmap.mmap(-1, sum(sizes) + HUGE_PAGE,
                          flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arena.madvise(advice)  # before the first touch: the pages fault in huge
    except (OSError, ValueError, AttributeError) as e:
        log.info("no huge-page arena for the weights (%s)", e)
        return 0
    raw = torch.frombuffer(arena, dtype=torch.uint8)  # keeps the mapping alive
    offset = -raw.data_ptr() % HUGE_PAGE
    with torch.no_grad():
        for p, size in zip(params, sizes, strict=True):
            n = p.numel() * p.element_size()
            home = raw[offset:offset + n].view(p.dtype).view(p.shape)
            home.copy_(p.data)
            p.data = home
            offset += size
    return offset - (-raw.data_ptr() % HUGE_PAGE)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor in a fresh anonymous mapping: the kernel hands out zero pages
    as they are first touched, so a large KV pool costs nothing until it holds tokens
    (``torch.zeros`` writes all of it up front: 0.65 s for SmolLM2's default pool)."""
    n = max(1, torch.Size(shape).numel() * dtype.itemsize)
    arena = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(arena, dtype=torch.uint8)[:n].view(dtype).view(shape)
