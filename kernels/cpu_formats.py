"""The C paged decode attention for every KV format (``cpu_kv_formats.c``, compiled with the
other C kernels by ``cpu.load``): float32 caches go to ``cpu.decode_attention``; 16-bit, fp8
(per tensor or per head), int8/int4 per token and head and KIVI caches are read packed, in
place, block by block (the scales applied outside the dot products, int4's rotation applied
to the query and the output instead of to every key; see the C file). Each side (K, V) is
described on its own, so a lab measurement that keeps one side in float32 (``kv_kept``) runs
here too.

``decode_attention`` returns None where it does not apply (a query not float32, tensors not
contiguous CPU tensors, no compiler): callers then use the torch reference.
"""

from __future__ import annotations

import ctypes

import torch

from kvscope.kernels import cpu
from kvscope.kernels import kv_formats as kf
from kvscope.kernels.kv_quant import PackedSide

# The kinds of cpu_kv_formats.c.
F32, BF16, F16, FP8, INT8, INT4, KIVI = range(7)
_PLAIN_KINDS = {torch.float32: F32, torch.bfloat16: BF16, torch.float16: F16,
                torch.float8_e4m3fn: FP8}
_SCHEME_KINDS = {"int8": INT8, "int4": INT4, "kivi": KIVI}
_NONE = 1 << 62  # res_start of a sequence without an open KIVI group


class _Side(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("bits", ctypes.c_int64), ("group", ctypes.c_int64),
                ("data", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("meta", ctypes.c_void_p)]


class _Packed(ctypes.Structure):
    _fields_ = [("k", _Side), ("v", _Side), ("fp8", ctypes.c_void_p),
                ("signs", ctypes.c_void_p), ("rht", ctypes.c_int64),
                ("residual", ctypes.c_void_p), ("res_rows", ctypes.c_int64),
                ("res_start", ctypes.c_void_p), ("res_row", ctypes.c_void_p)]


_fp8_values: torch.Tensor | None = None


def fp8_values() -> torch.Tensor:
    """The float32 value of each of the 256 e4m3 codes, as torch converts them."""
    global _fp8_values
    if _fp8_values is None:
        _fp8_values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return _fp8_values


def _cpu_contiguous(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def _side(cache: torch.Tensor, scale, head_dim: int, keep: list) -> _Side | None:
    """One side's description (its tensors appended to ``keep``, alive through the call);
    None when the C kernel does not read it."""
    if isinstance(scale, PackedSide):
        fmt = scale.fmt
        kind = _SCHEME_KINDS[fmt.scheme]
        meta = scale.meta[int(scale.is_value)] if kind == KIVI else scale.meta[0]
        group = fmt.group if kind == KIVI and not scale.is_value else 0
        blocks = cache.shape[:3]
        shape = ((blocks[0], blocks[1] // group, blocks[2], head_dim, 2) if group
                 else (*blocks, 2) if kind == KIVI else blocks)
        if (meta.dtype != (torch.float16 if kind == KIVI else torch.float32)
                or meta.shape != shape or not _cpu_contiguous(meta)
                or cache.shape[3] != fmt.packed_dim(head_dim) or group and blocks[1] % group):
            return None
        keep.append(meta)
        return _Side(kind, fmt.bits, group, cache.data_ptr(),
                     meta.data_ptr() if kind != KIVI else None,
                     meta.data_ptr() if kind == KIVI else None)
    kind = _PLAIN_KINDS.get(cache.dtype)
    if kind is None or cache.shape[3] != head_dim:
        return None
    per_head = None
    if kind == FP8:  # a float per layer or a [kv_heads, 1] tensor per layer and head
        per_head = (scale.float().reshape(-1).contiguous() if isinstance(scale, torch.Tensor)
                    else torch.full((cache.shape[2],), float(scale)))
        if per_head.numel() != cache.shape[2] or per_head.device.type != "cpu":
            return None
        keep.append(per_head)
    return _Side(kind, cache.element_size() * 8, 0, cache.data_ptr(),
                 None if per_head is None else per_head.data_ptr(), None)


def _residual(k_scale, batch: int, packed: _Packed, keep: list) -> bool:
    """KIVI: where each sequence's open group is in the residual. False: not readable here."""
    if not isinstance(k_scale, PackedSide) or k_scale.plan is None or k_scale.is_value:
        return True
    res = k_scale.residual
    if res is None or res.dtype != torch.float32 or not _cpu_contiguous(res):
        return False
    start, row = [_NONE] * batch, [0] * batch
    for b, first, r, _n in k_scale.plan.open_groups:
        start[b], row[b] = first, r
    start_t, row_t = torch.tensor(start), torch.tensor(row)
    keep += [res, start_t, row_t]
    packed.residual, packed.res_rows = res.data_ptr(), res.shape[0]
    packed.res_start, packed.res_row = start_t.data_ptr(), row_t.data_ptr()
    return True


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale,
                     max_seqlen_k, window=None, softcap=None) -> torch.Tensor | None:
    """The reference ``paged_decode_attention`` in C for any KV format; None when not
    applicable."""
    if not any(isinstance(s, PackedSide) for s in (k_scale, v_scale)) \
            and k_cache.dtype == v_cache.dtype == torch.float32:
        return cpu.decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                    max_seqlen_k, window, softcap)
    if (q.dtype != torch.float32 or q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4
            or torch.is_grad_enabled() and q.requires_grad
            or not _cpu_contiguous(q, k_cache, v_cache, block_tables, context_lens)
            or block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32
            or k_cache.shape[:3] != v_cache.shape[:3] or q.shape[1] % k_cache.shape[2]
            or block_tables.shape[0] != q.shape[0] or context_lens.shape != q.shape[:1]):
        return None
    batch, heads, d = q.shape
    keep: list[torch.Tensor] = []
    k, v = _side(k_cache, k_scale, d, keep), _side(v_cache, v_scale, d, keep)
    if k is None or v is None:
        return None
    packed = _Packed(k, v, fp8_values().data_ptr())
    if INT4 in (k.kind, v.kind):
        rht = d & -d
        signs = kf.rht_signs(rht).float().contiguous()
        keep.append(signs)
        packed.signs, packed.rht = signs.data_ptr(), rht
    if not _residual(k_scale, batch, packed, keep):
        return None
    lib = cpu.load()
    if lib is None:
        return None
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    status = lib.kv_decode_attention_packed(
        q.data_ptr(), ctypes.addressof(packed), block_tables.data_ptr(),
        block_tables.stride(0) if batch else 0, context_lens.data_ptr(), out.data_ptr(), batch,
        heads, kv_heads, d, block_size, k_cache.shape[0], window or 0, scale, softcap or 0.0,
        torch.get_num_threads())
    cpu._check(status, "decode attention: no memory for the score rows")
    return out
