"""Each quantized KV format against a plain numpy reference of the same math: scales, zero
points, rounding, the RHT, KIVI's grouping and residual, and the packing of 4- and 2-bit values
(element j of a byte at bits b*j)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvscope.engine.kivi_residual import KiviResidual
from kvscope.kernels import kv_formats as kf
from kvscope.kernels import reference
from kvscope.kernels.kv_quant import PackedSide


def rand(*shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * 3 + 0.5


def np_round_away(x):
    return np.where(x >= 0, np.floor(x + 0.5), np.ceil(x - 0.5))


def np_pack(q, bits):
    q = q.astype(np.uint8).reshape(*q.shape[:-1], -1, 8 // bits)
    return sum((q[..., j].astype(np.uint16) << (bits * j)) for j in range(8 // bits)).astype(
        np.uint8)


def np_hadamard(n):
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def test_int8_per_token_head():
    x = rand(7, 3, 64)
    q, scale = kf.quantize_int8(x)
    xn = x.numpy()
    s = np.maximum(np.abs(xn).max(-1) / np.float32(127), np.float32(1e-6)).astype(np.float32)
    qn = np.clip(np_round_away(xn * (np.float32(1) / s)[..., None]), -128, 127)
    assert np.array_equal(scale.numpy(), s)
    assert np.array_equal(q.numpy(), qn.astype(np.int8))
    assert np.allclose(kf.dequantize_int8(q, scale).numpy(), qn * s[..., None])
    assert np.abs(kf.dequantize_int8(q, scale).numpy() - xn).max() <= s.max() / 2 + 1e-6


@pytest.mark.parametrize("head_dim", [64, 48])  # 48: the RHT on blocks of 16
def test_int4_per_token_head(head_dim):
    x = rand(5, 2, head_dim, seed=1)
    b = head_dim & -head_dim
    signs = kf.rht_signs(b).numpy()
    xb = x.numpy().astype(np.float64).reshape(5, 2, -1, b)
    rotated = ((xb * signs) @ np_hadamard(b).T).reshape(5, 2, head_dim)
    assert np.allclose(kf.rht(x).numpy(), rotated, atol=1e-4)

    y = kf.rht(x).numpy()  # the quantization math on the module's rotation, bit for bit
    lo, hi = y.min(-1), y.max(-1)
    s = np.maximum((hi - lo) / np.float32(15), np.float32(1e-6)).astype(np.float32)
    zp = np.clip(np_round_away(-lo / s), 0, 15)
    qn = np.clip(np_round_away(y * (np.float32(1) / s)[..., None] + zp[..., None]), 0, 15)
    packed, packed_scale = kf.quantize_int4(x)
    assert np.array_equal(packed.numpy(), (qn[..., 0::2] + 16 * qn[..., 1::2]).astype(np.uint8))
    bits = packed_scale.numpy().view(np.int32)
    assert np.array_equal(bits & 15, zp.astype(np.int32))
    assert np.array_equal(bits & -16, s.view(np.int32) & -16)
    s_read = (bits & -16).view(np.float32)
    back = ((qn - zp[..., None]) * s_read[..., None]).reshape(5, 2, -1, b)
    back = (back @ np_hadamard(b).T * signs / b).reshape(5, 2, head_dim)
    got = kf.dequantize_int4(packed, packed_scale).numpy()
    assert np.allclose(got, back, atol=1e-4)
    assert np.abs(got - x.numpy()).max() < np.abs(x.numpy()).max() / 3


def np_asym(x, axis, bits):
    qmax = (1 << bits) - 1
    lo, hi = x.min(axis, keepdims=True), x.max(axis, keepdims=True)
    scale = np.maximum((hi - lo) / np.float32(qmax), np.float32(1e-5)).astype(np.float16)
    zero = lo.astype(np.float16)
    q = np.clip(np.round((x - zero.astype(np.float32)) / scale.astype(np.float32)), 0, qmax)
    return q, scale.astype(np.float32), zero.astype(np.float32)


@pytest.mark.parametrize("bits", [4, 2])
def test_kivi_k_per_channel_and_v_per_token(bits):
    k = rand(3, 8, 2, 16, seed=2)  # 3 groups of G = 8 tokens
    q, meta = kf.quantize_kivi_k(k, bits)
    qn, s, z = np_asym(k.numpy(), 1, bits)
    assert np.array_equal(q.numpy(), np_pack(qn, bits))
    assert np.array_equal(meta[..., 0].float().numpy(), s[:, 0])
    assert np.array_equal(meta[..., 1].float().numpy(), z[:, 0])
    assert np.allclose(kf.dequantize_kivi(q, meta[:, None], bits).numpy(), qn * s + z)

    v = rand(10, 2, 16, seed=3)
    q, meta = kf.quantize_kivi_v(v, bits)
    qn, s, z = np_asym(v.numpy(), -1, bits)
    assert np.array_equal(q.numpy(), np_pack(qn, bits))
    assert np.allclose(kf.dequantize_kivi(q, meta[..., None, :], bits).numpy(), qn * s + z)


def test_pack_order():
    q = torch.tensor([[1, 2, 3, 0, 3, 3, 0, 1]])
    assert kf.pack(q, 2).tolist() == [[1 | 2 << 2 | 3 << 4, 3 | 3 << 2 | 1 << 6]]
    assert kf.pack(q, 4).tolist() == [[1 | 2 << 4, 3, 3 | 3 << 4, 1 << 4]]
    assert torch.equal(kf.unpack(kf.pack(q, 2), 2), q.to(torch.uint8))


BS, G, HEADS, D, BITS = 8, 4, 2, 16, 2


def kivi_write(residual, k_cache, meta, table, keys, pieces):
    """Write ``keys`` of one sequence in passes of ``pieces`` tokens through the residual."""
    fmt = kf.kv_format(f"kivi{BITS}", BS, G)
    start = 0
    for n in pieces:
        plan = residual.plan([(table, start, start + n)], BS, torch.device("cpu"))
        side = PackedSide(fmt, False, meta, residual.k[0], plan)
        reference.store_kv(keys[start:start + n], keys[start:start + n], k_cache, k_cache.clone(),
                           torch.full((n,), -1), side, PackedSide(fmt, True, meta))
        start += n
    return side


@pytest.mark.parametrize("pieces", [[22], [5, 1, 1, 3, 7, 1, 1, 3], [1] * 22])
def test_kivi_residual_window(pieces):
    """However the 22 tokens arrive, the groups hold numpy's quantization of their own G tokens;
    the open group (positions 20-21) reads back in full precision; a second sequence hitting
    the first two blocks (their last group completed by single-token passes: the residual's
    edge) reads them as numpy says."""
    fmt = kf.kv_format(f"kivi{BITS}", BS, G)
    residual = KiviResidual(1, 2, G, HEADS, D, torch.float32, torch.device("cpu"))
    k_cache = torch.zeros(6, BS, HEADS, D * BITS // 8, dtype=torch.uint8)
    meta = (torch.zeros(6, BS // G, HEADS, D, 2, dtype=torch.float16),
            torch.zeros(6, BS, HEADS, 2, dtype=torch.float16))
    keys, table = rand(22, HEADS, D, seed=4), [4, 1, 3]
    side = kivi_write(residual, k_cache, meta, table, keys, pieces)

    groups = keys[:20].numpy().reshape(5, G, HEADS, D)
    qn, s, z = np_asym(groups, 1, BITS)
    stored = k_cache[table].view(-1, G, HEADS, D * BITS // 8)[:5]
    assert np.array_equal(stored.numpy(), np_pack(qn, BITS))
    expect = np.concatenate([(qn * s + z).reshape(20, HEADS, D), keys[20:].numpy()])
    got = reference.gather_kv(k_cache, torch.tensor(table), 22, side)
    assert np.allclose(got.numpy(), expect, atol=1e-6)
    assert torch.equal(got[20:], keys[20:])  # the residual: full precision
    assert list(residual.slot_of) == [3]  # the open group's block holds the one slot

    hit = PackedSide(fmt, False, meta)  # no open group of its own in the shared blocks
    got = reference.gather_kv(k_cache, torch.tensor(table[:2]), 16, hit)
    assert np.allclose(got.numpy(), expect[:16], atol=1e-6)


def test_kivi_residual_slot_comes_back_when_the_block_is_freed_or_copied():
    residual = KiviResidual(1, 1, G, HEADS, D, torch.float32, torch.device("cpu"))
    residual.plan([([0], 0, 2)], BS, torch.device("cpu"))
    residual.k[0, :2] = 7.0
    with pytest.raises(RuntimeError, match="residual slots"):
        residual.plan([([1], 0, 1)], BS, torch.device("cpu"))
    residual.on_free(0)
    residual.copy([])
    residual.drop_freed()
    assert residual.slot_of == {} and residual.free == [0]
    residual.plan([([2], 0, 3)], BS, torch.device("cpu"))
    residual.on_free(2)
    more = KiviResidual(1, 2, G, HEADS, D, torch.float32, torch.device("cpu"))
    more.plan([([0], 0, 2)], BS, torch.device("cpu"))
    more.k[0, :3] = 5.0
    more.copy([(0, 6)])
    assert torch.equal(more.k[0, 3:6], more.k[0, :3])


@pytest.mark.parametrize("name,bits", [("int8_per_token_head", 8), ("int4_per_token_head", 4),
                                       ("kivi4", 4), ("kivi2", 2)])
def test_meta_shapes_match_the_bytes_per_token(name, bits):
    fmt = kf.kv_format(name, 16)
    per_block = 2 * 16 * 3 * fmt.packed_dim(64)
    for shape, sides, dtype in fmt.meta_shapes(16, 3, 64):
        per_block += sides * int(np.prod(shape)) * dtype.itemsize
    assert per_block == 16 * fmt.bytes_per_token(3, 64)
    assert fmt.bits == bits


def test_unknown_format_and_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="accepted: auto"):
        kf.kv_format("int3")
    with pytest.raises(ValueError, match="must divide"):
        kf.kv_format("kivi4", 16, group=6)
    with pytest.raises(ValueError, match="multiple of 4"):
        kf.check_shape(kf.kv_format("kivi2"), 18)
