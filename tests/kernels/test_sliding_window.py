"""Sliding-window attention (a query at q sees the keys at q - W < k <= q) in every kernel
backend, against dense attention with the window mask written here; and the decode kernels that
claim to skip the blocks before the window do not read them."""

import pytest
import torch
from kv_testutil import build_paged, dense_causal_attention

from kvscope.kernels import paged_decode_attention, paged_prefill_attention

pytest.importorskip("triton")

IMPLS = ["torch", "cpu", "triton"]
# float32 throughout; the tiled softmax sums in another order than the dense one.
ATOL = 2e-5


def _case(ctx_lens, block_size, kv_heads=2, head_dim=16, seed=0):
    k_cache, v_cache, tables, dense = build_paged(ctx_lens, kv_heads, head_dim, block_size,
                                                  torch.float32, seed=seed)
    return k_cache, v_cache, tables, dense, torch.tensor(ctx_lens, dtype=torch.int32)


# (context lengths, new tokens per sequence, block size, window): a prefix before the chunk
# (chunked prefill, a cache hit), windows shorter than the chunk, than a block, and longer than
# the context (no effect), tiles of the triton kernel (32 rows) wholly before a window.
PREFILL = [
    ([40, 75], [40, 30], 8, 16),
    ([100], [70], 16, 5),
    ([33, 64, 9], [1, 64, 9], 4, 3),
    ([130], [130], 16, 40),
    ([20], [20], 8, 64),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("ctx_lens", "q_lens", "block_size", "window"), PREFILL)
def test_prefill_within_the_window_matches_dense(impl, ctx_lens, q_lens, block_size, window):
    k_cache, v_cache, tables, dense, ctx = _case(ctx_lens, block_size)
    heads = 4
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(sum(q_lens), heads, 16, generator=gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, 0.25, impl=impl,
                                  window=window)
    for b, (k, v) in enumerate(dense):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        want = dense_causal_attention(q[rows], k, v, 0.25, window=window)
        torch.testing.assert_close(out[rows], want, atol=ATOL, rtol=0)
    if window < max(ctx_lens):  # the window changes the result: the check above can fail
        k, v = dense[-1]
        rows = slice(int(cu[-2]), int(cu[-1]))
        assert not torch.allclose(out[rows], dense_causal_attention(q[rows], k, v, 0.25),
                                  atol=1e-3)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("ctx_lens", "block_size", "window"), [
    ([50, 7, 300], 8, 20), ([64], 16, 16), ([65], 16, 1), ([12, 600], 32, 100)])
def test_decode_within_the_window_matches_dense(impl, ctx_lens, block_size, window):
    k_cache, v_cache, tables, dense, ctx = _case(ctx_lens, block_size)
    q = torch.randn(len(ctx_lens), 4, 16, generator=torch.Generator().manual_seed(2))
    out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.25, impl=impl,
                                 window=window)
    for b, (k, v) in enumerate(dense):
        want = dense_causal_attention(q[b:b + 1], k, v, 0.25, window=window)[0]
        torch.testing.assert_close(out[b], want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("impl", ["cpu", "triton"])
def test_decode_does_not_read_the_blocks_before_the_window(impl):
    """The blocks wholly before the window are filled with NaN (a read of one, even masked,
    turns the output NaN through 0 * NaN): the C and triton decode kernels stay finite."""
    block_size, window, n = 8, 20, 90
    k_cache, v_cache, tables, dense, ctx = _case([n], block_size)
    before = (n - window) // block_size  # blocks 0 .. before-1 hold no position in the window
    for cache in (k_cache, v_cache):
        cache[tables[0, :before].long()] = float("nan")
    q = torch.randn(1, 4, 16, generator=torch.Generator().manual_seed(3))
    out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.25, impl=impl,
                                 window=window)
    k, v = dense[0]
    torch.testing.assert_close(out[0], dense_causal_attention(q, k, v, 0.25, window=window)[0],
                               atol=ATOL, rtol=0)
    full = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.25, impl=impl)
    assert full.isnan().all()  # without the window the NaN blocks are read: the test can fail
