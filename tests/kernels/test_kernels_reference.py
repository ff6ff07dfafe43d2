"""The torch reference checked against dense attention on unpaged K/V: this makes it an oracle."""

import math

import pytest
import torch
from kv_testutil import FP8, build_paged, dense_causal_attention

from kvscope.kernels import (
    copy_blocks,
    kv_cache_dtype_of,
    paged_decode_attention,
    paged_prefill_attention,
    reference,
    store_kv,
)

# Same float32 math as SDPA, different summation order.
REF_ATOL = 2e-5
# A float16 output is rounded once: half an ulp at |x| < 4.
HALF_OUT_ATOL = 2e-3
# e4m3 keeps 3 mantissa bits: round-to-nearest error <= 2^-4 relative, plus the subnormal step.
FP8_REL = 2.0**-4
FP8_SUBNORMAL = 2.0**-9


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_prefill_matches_dense_with_cached_prefix(block_size, group):
    num_kv_heads, head_dim = 2, 16
    ctx_lens = [37, 5, 64, 20]
    q_lens = [11, 5, 1, 20]  # prefix + new, all new, one new token, all new at a block edge
    k_cache, v_cache, tables, dense = build_paged(ctx_lens, num_kv_heads, head_dim, block_size,
                                                  torch.float32, seed=block_size + group)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = 1 / math.sqrt(head_dim)
    out = paged_prefill_attention(q, k_cache, v_cache, tables, cu, torch.tensor(ctx_lens,
                                  dtype=torch.int32), scale, impl="torch")
    for b, (k, v) in enumerate(dense):
        want = dense_causal_attention(q[cu[b]:cu[b + 1]], k, v, scale)
        torch.testing.assert_close(out[cu[b]:cu[b + 1]], want, atol=REF_ATOL, rtol=0)


def test_prefill_chunked_queries_match_unchunked(monkeypatch):
    k_cache, v_cache, tables, dense = build_paged([50], 2, 8, 16, torch.float32)
    q = torch.randn(30, 4, 8)
    cu = torch.tensor([0, 30], dtype=torch.int32)
    args = (q, k_cache, v_cache, tables, cu, torch.tensor([50], dtype=torch.int32), 0.3)
    whole = paged_prefill_attention(*args, impl="torch")
    monkeypatch.setattr(reference, "_MAX_SCORE_ELEMENTS", 4 * 50 * 7)  # 7 query rows per chunk
    chunked = paged_prefill_attention(*args, impl="torch")
    torch.testing.assert_close(chunked, whole, atol=REF_ATOL, rtol=0)
    torch.testing.assert_close(whole, dense_causal_attention(q, *dense[0], 0.3),
                               atol=REF_ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_matches_dense(block_size, group, dtype):
    num_kv_heads, head_dim = 2, 32
    ctx_lens = [1, 17, 48, 33]
    k_cache, v_cache, tables, dense = build_paged(ctx_lens, num_kv_heads, head_dim, block_size,
                                                  dtype, seed=7)
    q = torch.randn(len(ctx_lens), num_kv_heads * group, head_dim).to(dtype)
    out = paged_decode_attention(q, k_cache, v_cache, tables,
                                 torch.tensor(ctx_lens, dtype=torch.int32), 0.2, impl="torch")
    assert out.dtype == dtype and out.shape == q.shape
    atol = REF_ATOL if dtype == torch.float32 else HALF_OUT_ATOL
    for b, (k, v) in enumerate(dense):
        want = dense_causal_attention(q[b:b + 1].float(), k, v, 0.2)[0]
        torch.testing.assert_close(out[b].float(), want, atol=atol, rtol=0)


def test_decode_with_fp8_scales_matches_dense():
    ctx_lens = [9, 40]
    k_cache, v_cache, tables, dense = build_paged(ctx_lens, 2, 16, 8, FP8, k_scale=0.05,
                                                  v_scale=2.0)
    q = torch.randn(2, 4, 16)
    out = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(ctx_lens), 0.25,
                                 k_scale=0.05, v_scale=2.0, impl="torch")
    for b, (k, v) in enumerate(dense):
        want = dense_causal_attention(q[b:b + 1], k, v, 0.25)[0]
        torch.testing.assert_close(out[b], want, atol=REF_ATOL * 10, rtol=0)


def test_store_kv_writes_the_slot_formula_and_skips_padding():
    block_size, kv_heads, head_dim = 4, 2, 3
    k_cache = torch.zeros(6, block_size, kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(5, kv_heads, head_dim)
    value = torch.randn(5, kv_heads, head_dim)
    slots = torch.tensor([9, -1, 0, 23, 14])
    store_kv(key, value, k_cache, v_cache, slots, impl="torch")
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // block_size, slot % block_size], key[t])
            assert torch.equal(v_cache[slot // block_size, slot % block_size], value[t])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 4  # the padded token wrote nothing


def test_fp8_cache_halves_bytes_and_round_trips_within_e4m3_precision():
    shape = (4, 16, 2, 64)
    half = torch.zeros(shape, dtype=torch.float16)
    k_cache = torch.zeros(shape, dtype=kv_cache_dtype_of("fp8", torch.float16))
    v_cache = torch.zeros_like(k_cache)
    assert k_cache.element_size() * 2 == half.element_size()
    assert k_cache.nbytes * 2 == half.nbytes
    key = torch.randn(64, 2, 64, dtype=torch.float16) * 4
    value = torch.randn(64, 2, 64, dtype=torch.float16) * 0.01
    k_scale, v_scale = 0.05, 1e-4  # pick scales so values land inside the e4m3 range
    store_kv(key, value, k_cache, v_cache, torch.arange(64), k_scale, v_scale, impl="torch")
    for x, cache, s in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        back = reference.dequantize(cache.view(-1, 2, 64), s)
        bound = x.float().abs() * FP8_REL + FP8_SUBNORMAL * s
        assert ((back - x.float()).abs() <= bound).all()
        assert (back - x.float()).abs().max() > 0  # it really was quantised


def test_fp8_store_saturates_instead_of_nan():
    k_cache = torch.zeros(1, 2, 1, 2, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    big = torch.tensor([[[1e4, -1e4]], [[1.0, 2.0]]])
    store_kv(big, big, k_cache, v_cache, torch.tensor([0, 1]), impl="torch")
    assert k_cache.float().flatten().tolist() == [448.0, -448.0, 1.0, 2.0]


def test_decode_agrees_with_single_token_prefill():
    ctx_lens = [12, 30]
    k_cache, v_cache, tables, _ = build_paged(ctx_lens, 1, 16, 8, torch.float32)
    q = torch.randn(2, 2, 16)
    lens = torch.tensor(ctx_lens, dtype=torch.int32)
    dec = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, impl="torch")
    pre = paged_prefill_attention(q, k_cache, v_cache, tables,
                                  torch.tensor([0, 1, 2], dtype=torch.int32), lens, 0.25,
                                  impl="torch")
    torch.testing.assert_close(dec, pre, atol=REF_ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=str)
def test_copy_blocks_copies_whole_blocks(dtype):
    k_cache = torch.randn(5, 4, 2, 8).to(dtype)
    v_cache = torch.randn(5, 4, 2, 8).to(dtype)
    k_before, v_before = k_cache.float(), v_cache.float()
    copy_blocks(k_cache, v_cache, [(1, 3), (4, 0)])
    k_after, v_after = k_cache.float(), v_cache.float()
    assert torch.equal(k_after[3], k_before[1]) and torch.equal(v_after[0], v_before[4])
    assert torch.equal(k_after[[1, 2, 4]], k_before[[1, 2, 4]])
    copy_blocks(k_cache, v_cache, [])


def test_kv_cache_dtype_of():
    assert kv_cache_dtype_of("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype_of("fp16", torch.float32) == torch.float16
    assert kv_cache_dtype_of("bf16", torch.float32) == torch.bfloat16
    assert kv_cache_dtype_of("float32", torch.float16) == torch.float32
    assert kv_cache_dtype_of("float8_e4m3", torch.float16) == FP8
    assert kv_cache_dtype_of("fp8", torch.float16) == FP8
    with pytest.raises(ValueError, match="auto.*fp8"):
        kv_cache_dtype_of("int4", torch.float16)


def test_impl_must_be_known():
    with pytest.raises(ValueError, match="impl"):
        store_kv(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1), torch.zeros(1, 1, 1, 1),
                 torch.zeros(1, 1, 1, 1), torch.tensor([0]), impl="cuda")


def test_reference_accepts_non_contiguous_queries():
    k_cache, v_cache, tables, dense = build_paged([12], 2, 16, 8, torch.float32)
    q = torch.randn(4, 10, 16).transpose(0, 1)  # [10 tokens, 4 heads, 16], not contiguous
    lens = torch.tensor([12], dtype=torch.int32)
    out = paged_prefill_attention(q, k_cache, v_cache, tables,
                                  torch.tensor([0, 10], dtype=torch.int32), lens, 0.25,
                                  impl="torch")
    torch.testing.assert_close(out, dense_causal_attention(q, *dense[0], 0.25),
                               atol=REF_ATOL, rtol=0)
    dec = paged_decode_attention(q[-1:], k_cache, v_cache, tables, lens, 0.25, impl="torch")
    torch.testing.assert_close(dec, out[-1:], atol=REF_ATOL, rtol=0)
