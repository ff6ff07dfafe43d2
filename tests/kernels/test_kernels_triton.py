"""Each triton kernel against the torch reference (under TRITON_INTERPRET=1 on a CPU machine)."""

import math

import pytest
import torch
from kv_testutil import FP8, build_paged

from kvscope.kernels import paged_decode_attention, paged_prefill_attention, store_kv

pytest.importorskip("triton")

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# Online (tiled) softmax and split-K sum in another order than the reference: float32 rounding.
F32_ATOL = 2e-5
# Output rounding: one ulp of the output dtype (the interpreter truncates bfloat16; torch rounds).
OUT_REL = {F32: 0.0, F16: torch.finfo(F16).eps, BF16: torch.finfo(BF16).eps}
# e4m3: one ulp (2^-3 relative; x / scale may round differently on a GPU) plus the subnormal step.
FP8_REL, FP8_SUBNORMAL = 2.0**-3, 2.0**-9

def _id(value):
    return str(value).removeprefix("torch.")


# The model dtype that goes with each cache dtype; fp8 caches hold fp16 models here.
MODEL_DTYPE = {F32: F32, F16: F16, BF16: BF16, FP8: F16}


def assert_matches(actual, expected, atol=F32_ATOL):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a, e = actual.float(), expected.float()
    bound = atol + OUT_REL[actual.dtype] * e.abs()
    bad = (a - e).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} mismatches, max err {(a - e).abs().max():.3g}"


def scales_for(cache_dtype):
    return (0.5, 0.25) if cache_dtype == FP8 else (1.0, 1.0)


def make_case(ctx_lens, num_kv_heads, head_dim, block_size, cache_dtype, seed=0):
    k_scale, v_scale = scales_for(cache_dtype)
    k_cache, v_cache, tables, _ = build_paged(ctx_lens, num_kv_heads, head_dim, block_size,
                                              cache_dtype, k_scale=k_scale, v_scale=v_scale,
                                              seed=seed)
    return k_cache, v_cache, tables, torch.tensor(ctx_lens, dtype=torch.int32), k_scale, v_scale


# (block_size, GQA group, cache dtype): every block size, ratio and dtype appears at least once.
PREFILL_CASES = [
    (8, 1, F32), (16, 2, F16), (32, 4, BF16), (16, 8, FP8),
    (8, 4, FP8), (32, 1, F16), (16, 2, BF16), (8, 8, F32),
]


@pytest.mark.parametrize(("block_size", "group", "cache_dtype"), PREFILL_CASES, ids=_id)
def test_prefill_triton_matches_reference(block_size, group, cache_dtype):
    # A cached prefix with more new tokens than one query tile; all-new; a single token;
    # and all-new ending exactly on a block boundary.
    ctx_lens, q_lens = [75, 5, 40, 32], [40, 5, 1, 32]
    num_kv_heads, head_dim = 2 if group < 8 else 1, 32
    k_cache, v_cache, tables, lens, k_scale, v_scale = make_case(
        ctx_lens, num_kv_heads, head_dim, block_size, cache_dtype, seed=block_size * group)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim).to(MODEL_DTYPE[cache_dtype])
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (q, k_cache, v_cache, tables, cu, lens, 1 / math.sqrt(head_dim), k_scale, v_scale)
    assert_matches(paged_prefill_attention(*args, impl="triton"),
                   paged_prefill_attention(*args, impl="torch"))


def test_prefill_triton_with_strided_queries_and_float32_model():
    k_cache, v_cache, tables, lens, _, _ = make_case([20, 9], 2, 16, 8, F16)
    qkv = torch.randn(29, 3, 4, 16)
    q = qkv[:, 0]  # a view, as when q/k/v are split from one projection
    cu = torch.tensor([0, 20, 29], dtype=torch.int32)
    args = (q, k_cache, v_cache, tables, cu, lens, 0.25)
    assert_matches(paged_prefill_attention(*args, impl="triton", max_seqlen_q=20),
                   paged_prefill_attention(*args, impl="torch"))


# (block_size, group, cache dtype, num_splits): None is the automatic choice.
DECODE_CASES = [
    (8, 1, F32, None), (16, 2, F16, 1), (32, 4, BF16, 3), (16, 8, FP8, 2),
    (8, 4, FP8, 7), (32, 2, F32, 16), (16, 1, BF16, None),
]


@pytest.mark.parametrize(("block_size", "group", "cache_dtype", "num_splits"), DECODE_CASES,
                         ids=_id)
def test_decode_triton_matches_reference(block_size, group, cache_dtype, num_splits):
    ctx_lens = [1, 70, 33, 16]
    num_kv_heads, head_dim = 2, 32
    k_cache, v_cache, tables, lens, k_scale, v_scale = make_case(
        ctx_lens, num_kv_heads, head_dim, block_size, cache_dtype, seed=block_size + group)
    q = torch.randn(len(ctx_lens), num_kv_heads * group, head_dim).to(MODEL_DTYPE[cache_dtype])
    args = (q, k_cache, v_cache, tables, lens, 1 / math.sqrt(head_dim), k_scale, v_scale)
    got = paged_decode_attention(*args, num_splits=num_splits, impl="triton")
    assert_matches(got, paged_decode_attention(*args, impl="torch"))


def test_decode_split_count_does_not_change_the_result():
    k_cache, v_cache, tables, lens, _, _ = make_case([100, 3], 1, 16, 8, F32)
    q = torch.randn(2, 2, 16)
    outs = [paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, num_splits=n,
                                   impl="triton") for n in (1, 4, 9)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=F32_ATOL, rtol=0)


def _stored(cache, slots):
    flat = cache.view(-1, cache.shape[2], cache.shape[3])
    return flat[slots].float()


@pytest.mark.parametrize(("model_dtype", "cache_dtype"),
                         [(F32, F32), (F16, F16), (BF16, BF16), (F16, FP8), (F32, BF16)], ids=_id)
def test_store_kv_triton_matches_reference(model_dtype, cache_dtype):
    num_blocks, block_size, num_kv_heads, head_dim = 6, 8, 3, 24  # non power-of-two heads/dims
    k_scale, v_scale = scales_for(cache_dtype)
    gen = torch.Generator().manual_seed(1)
    kv = (torch.randn(12, 2, num_kv_heads, head_dim, generator=gen) * 4).to(model_dtype)
    key, value = kv[:, 0], kv[:, 1]  # strided views
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:12]
    slots[[3, 7]] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = {}
    for impl in ("torch", "triton"):
        k_cache = torch.full(shape, 7.0).to(cache_dtype)
        v_cache = torch.full(shape, 7.0).to(cache_dtype)
        store_kv(key, value, k_cache, v_cache, slots, k_scale, v_scale, impl=impl)
        caches[impl] = (k_cache, v_cache)
    kept = slots[slots >= 0]
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[kept] = False
    for want, got in zip(caches["torch"], caches["triton"], strict=True):
        a, e = _stored(got, kept), _stored(want, kept)
        if cache_dtype == FP8:
            bound = FP8_REL * torch.maximum(a.abs(), e.abs()) + FP8_SUBNORMAL
        elif model_dtype == cache_dtype:
            bound = torch.zeros_like(e)  # a plain copy
        else:
            bound = OUT_REL[cache_dtype] * e.abs()
        assert ((a - e).abs() <= bound).all()
        assert (_stored(got, untouched) == 7.0).all()  # padding (-1) and other slots untouched


def test_store_kv_triton_fp8_rounds_like_torch_on_every_e4m3_value_and_midpoint():
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[~grid.isnan()].unique()  # sorted, -448..448 with +-0 merged
    mids = (grid[1:] + grid[:-1]) / 2  # ties: round-to-nearest-even decides
    x = torch.cat([grid, mids, grid * 1.01, torch.tensor([500.0, -1e4])])
    head_dim = 32
    x = torch.cat([x, torch.zeros(-len(x) % head_dim)]).view(-1, 1, head_dim)
    slots = torch.arange(x.shape[0])
    results = []
    for impl in ("torch", "triton"):
        cache = torch.zeros(x.shape[0], 1, 1, head_dim, dtype=FP8)
        store_kv(x, x, cache, torch.zeros_like(cache), slots, impl=impl)
        results.append(cache.float())
    assert torch.equal(results[0], results[1])


def test_auto_impl_uses_torch_on_cpu(monkeypatch):
    from kvscope.kernels import triton_attention

    def boom(*args, **kwargs):
        raise AssertionError("triton called for CPU tensors")

    monkeypatch.setattr(triton_attention, "paged_decode_attention", boom)
    k_cache, v_cache, tables, lens, _, _ = make_case([5], 1, 16, 8, F32)
    out = paged_decode_attention(torch.randn(1, 1, 16), k_cache, v_cache, tables, lens, 0.25)
    assert out.shape == (1, 1, 16)
    with pytest.raises(AssertionError, match="triton called"):
        paged_decode_attention(torch.randn(1, 1, 16), k_cache, v_cache, tables, lens, 0.25,
                               impl="triton")


@pytest.mark.parametrize("cache_dtype", [F16, FP8], ids=_id)
def test_chunked_prefill_then_decode_pipeline_matches_dense(cache_dtype):
    """The way the model runner uses the kernels: store, attend; a second chunk; then decode."""
    from kv_testutil import dense_causal_attention, from_cache, to_cache

    block_size, num_kv_heads, group, head_dim = 8, 2, 2, 16
    k_scale, v_scale = scales_for(cache_dtype)
    gen = torch.Generator().manual_seed(3)
    n = 30  # chunks of 20 and 9 tokens, then one decode token
    k = torch.randn(n, num_kv_heads, head_dim, generator=gen).half()
    v = torch.randn(n, num_kv_heads, head_dim, generator=gen).half()
    q = torch.randn(n, num_kv_heads * group, head_dim, generator=gen).half()
    table = torch.tensor([[5, 0, 3, 6]], dtype=torch.int32)
    slots = torch.cat([table[0, p // block_size:p // block_size + 1] * block_size
                       + p % block_size for p in range(n)]).long()
    shape = (7, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(shape).to(cache_dtype), torch.zeros(shape).to(cache_dtype)
    outs = []
    for lo, hi in ((0, 20), (20, 29)):
        store_kv(k[lo:hi], v[lo:hi], k_cache, v_cache, slots[lo:hi], k_scale, v_scale,
                 impl="triton")
        cu = torch.tensor([0, hi - lo], dtype=torch.int32)
        outs.append(paged_prefill_attention(q[lo:hi], k_cache, v_cache, table, cu,
                                            torch.tensor([hi], dtype=torch.int32), 0.25,
                                            k_scale, v_scale, impl="triton"))
    store_kv(k[29:], v[29:], k_cache, v_cache, slots[29:], k_scale, v_scale, impl="triton")
    outs.append(paged_decode_attention(q[29:], k_cache, v_cache, table,
                                       torch.tensor([n], dtype=torch.int32), 0.25, k_scale,
                                       v_scale, num_splits=2, impl="triton"))
    # Dense oracle on what the cache can represent.
    k_seen = from_cache(to_cache(k, cache_dtype, k_scale), k_scale)
    v_seen = from_cache(to_cache(v, cache_dtype, v_scale), v_scale)
    want = dense_causal_attention(q.float(), k_seen, v_seen, 0.25).half()
    got = torch.cat(outs)
    assert_matches(got, want)


def test_tile_shapes_meet_the_gpu_dot_minimum():
    """tl.dot needs every dimension >= 16 on a GPU; the interpreter would not notice."""
    from kvscope.kernels import triton_attention as ta

    assert ta.BLOCK_N >= 16 and ta.PREFILL_BLOCK_M >= 16
    for head_dim in (8, 16, 64, 80, 96, 128, 256):
        block = ta._head_block(head_dim)
        assert block >= max(16, head_dim) and block & (block - 1) == 0


def test_launchers_refuse_tensors_on_another_device():
    from kvscope.kernels import kernel_backend

    meta = dict(device="meta")
    q = torch.empty(2, 4, 16, **meta)
    cache = torch.empty(6, 8, 2, 16, **meta)
    tables, lens = torch.zeros(2, 3, dtype=torch.int32), torch.tensor([5, 9], dtype=torch.int32)
    triton = kernel_backend("triton", "cpu")
    with pytest.raises(AssertionError, match="a cpu tensor passed with meta queries"):
        triton.paged_decode_attention(q, cache, cache, tables, lens, 0.25, 1.0, 1.0, 9)
    with pytest.raises(AssertionError, match="different devices"):
        triton.store_kv(q[:, :2], q[:, :2], cache, cache, torch.tensor([0, 1]), 1.0, 1.0)


def test_fp8_cache_needs_compute_capability_8_9(monkeypatch):
    from kvscope.kernels import check_fp8_support

    check_fp8_support("cpu")  # the reference handles fp8 anywhere
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_support("cuda")  # Hopper
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"8\.9 or newer.*this one is 8\.0"):
        check_fp8_support("cuda")
