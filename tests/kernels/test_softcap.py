"""Attention logit soft-capping (Gemma 2: each scaled score s becomes tanh(s / C) * C before the
mask and softmax) in every kernel backend, prefill and decode, against the dense oracle; with a
sliding window too, as Gemma 2's local layers have both."""

import pytest
import torch
from kv_testutil import build_paged, dense_causal_attention

from kvscope.kernels import paged_decode_attention, paged_prefill_attention

pytest.importorskip("triton")

IMPLS = ["torch", "cpu", "triton"]
ATOL = 2e-5
# Scores of |s| up to ~10 here (scale 1, head_dim 16, values ~N(0, 3)): a cap of 5 bends them.
SCALE, CAP = 1.0, 5.0


def _case(ctx_lens, block_size):
    k_cache, v_cache, tables, dense = build_paged(ctx_lens, 2, 16, block_size, torch.float32,
                                                  seed=4)
    return k_cache, v_cache, tables, dense, torch.tensor(ctx_lens, dtype=torch.int32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [None, 6])
def test_prefill_with_softcap_matches_dense(impl, window):
    ctx_lens, q_lens = [40, 9], [20, 9]  # a cached prefix; all new
    k_cache, v_cache, tables, dense, ctx = _case(ctx_lens, 8)
    q = torch.randn(sum(q_lens), 4, 16, generator=torch.Generator().manual_seed(5))
    cu = torch.tensor([0, 20, 29], dtype=torch.int32)
    out = paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, SCALE, impl=impl,
                                  window=window, softcap=CAP)
    for b, (k, v) in enumerate(dense):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        want = dense_causal_attention(q[rows], k, v, SCALE, window=window, softcap=CAP)
        torch.testing.assert_close(out[rows], want, atol=ATOL, rtol=0)
        # the cap changes the result: the check above can fail
        assert not torch.allclose(out[rows], dense_causal_attention(q[rows], k, v, SCALE,
                                                                    window=window), atol=1e-3)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [None, 6])
def test_decode_with_softcap_matches_dense(impl, window):
    ctx_lens = [50, 7]
    k_cache, v_cache, tables, dense, ctx = _case(ctx_lens, 8)
    q = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(6))
    out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, SCALE, impl=impl,
                                 window=window, softcap=CAP)
    for b, (k, v) in enumerate(dense):
        want = dense_causal_attention(q[b:b + 1], k, v, SCALE, window=window, softcap=CAP)[0]
        torch.testing.assert_close(out[b], want, atol=ATOL, rtol=0)
    k, v = dense[0]
    assert not torch.allclose(out[0], dense_causal_attention(q[:1], k, v, SCALE,
                                                             window=window)[0], atol=1e-3)
