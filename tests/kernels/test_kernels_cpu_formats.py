"""The C decode attention on every KV format (kernels/cpu_formats.py, cpu_kv_formats.c) against
the torch reference's dequantize-then-attend, on caches written by the reference store.

Tolerance: both read the same stored codes and scales, so they differ only by float32
rounding: dot products summed in another order, scales applied to a dot instead of to each
element, KIVI's zero points factored out of the dot (q . z added once), int4's rotation applied
to the query and the output instead of to each key. The worst seen here is 8e-6 on outputs of
magnitude ~3 (int4, head_dim 128); ATOL is 2.5x that and 25x below what the finest format's
own rounding does to these outputs (float16: 5e-4 against float32; every format is checked
to differ from float32 by over 10x ATOL), so a wrong scale, row, group or nibble cannot pass.
"""

from __future__ import annotations

import math

import pytest
import torch
from kv_format_testutil import build_format_cache

from kvscope.kernels import cpu, cpu_formats, kernel_backend, reference

ATOL, RTOL = 2e-5, 1e-5
FORMATS = ["bfloat16", "float16", "fp8", "fp8_per_head", "int8_per_token_head",
           "int4_per_token_head", "kivi4", "kivi2"]
# Block size 16, KIVI group 16 unless said: 1 and 37 and 130 end inside an open KIVI group (in
# the residual), 16 and 64 complete theirs at this decode step, 5 is one group, still open.
LENGTHS = [1, 5, 16, 37, 64, 130]


@pytest.fixture(autouse=True)
def _threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def both(c, q, window=None, softcap=None):
    """(C, reference) outputs of one decode step over the cache ``c``."""
    scale, longest = 1 / math.sqrt(q.shape[2]), int(c.lens.max())
    args = (q, c.k_cache, c.v_cache, c.tables, c.lens, scale, c.k_scale, c.v_scale, longest)
    got = cpu_formats.decode_attention(*args, window=window, softcap=softcap)
    assert got is not None, "the C kernel declined: the test would compare the reference to itself"
    return got, reference.paged_decode_attention(*args, window=window, softcap=softcap)


def test_the_library_builds_here():
    assert cpu.load() is not None, "no C compiler (cc) found: kvscope's CPU kernels are off"


@pytest.mark.parametrize("group", [1, 3])  # query heads per KV head (GQA)
@pytest.mark.parametrize("head_dim", [64, 128, 96])  # 96: int4 rotates two blocks of 32
@pytest.mark.parametrize("name", FORMATS)
def test_each_format_equals_the_reference(name, head_dim, group):
    torch.set_num_threads(1)
    c = build_format_cache(name, LENGTHS, 2, head_dim, 16, seed=head_dim + group)
    q = torch.randn(len(LENGTHS), 2 * group, head_dim, generator=torch.Generator().manual_seed(1))
    got, want = both(c, q)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", ["int4_per_token_head", "kivi4", "kivi2", "fp8_per_head"])
@pytest.mark.parametrize(("window", "softcap"), [(20, None), (7, None), (None, 30.0), (40, 5.0)])
def test_sliding_window_and_softcap(name, window, softcap):
    """Windows that start inside a block and inside a KIVI group, and one (7) that lies wholly
    in an open group (the residual) for the 37-token context; threads split the work."""
    torch.set_num_threads(2)
    c = build_format_cache(name, LENGTHS, 2, 64, 16, seed=7)
    q = torch.randn(len(LENGTHS), 6, 64, generator=torch.Generator().manual_seed(2)) * 3
    got, want = both(c, q, window, softcap)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", ["kivi4", "kivi2"])
@pytest.mark.parametrize(("block_size", "kivi_group"), [(16, 8), (16, 4), (8, 8)])
def test_kivi_groups_smaller_than_a_block(name, block_size, kivi_group):
    """Several K groups per block: each group's own per-channel scales."""
    lengths = [3, 12, 21, 45]
    c = build_format_cache(name, lengths, 3, 64, block_size, group=kivi_group, seed=9)
    q = torch.randn(len(lengths), 3, 64, generator=torch.Generator().manual_seed(3))
    got, want = both(c, q)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_one_side_kept_in_float32():
    """The lab's K-or-V measurement (kv_kept): one side a float32 cache, the other packed."""
    c = build_format_cache("int4_per_token_head", LENGTHS, 2, 64, 16, seed=4)
    f = build_format_cache("float32", LENGTHS, 2, 64, 16, seed=4)
    q = torch.randn(len(LENGTHS), 4, 64)
    for k_cache, v_cache, k_scale, v_scale in ((f.k_cache, c.v_cache, 1.0, c.v_scale),
                                               (c.k_cache, f.v_cache, c.k_scale, 1.0)):
        args = (q, k_cache, v_cache, c.tables, c.lens, 0.125, k_scale, v_scale, 130)
        got = cpu_formats.decode_attention(*args)
        assert got is not None
        torch.testing.assert_close(got, reference.paged_decode_attention(*args), atol=ATOL,
                                   rtol=RTOL)


def test_the_cpu_backend_takes_it_and_quantization_shows():
    """Through the "cpu" backend; and every format differs from float32 by over 10x ATOL, so
    equality with the reference above is not equality with anything close."""
    backend = kernel_backend(None, "cpu")
    q = torch.randn(len(LENGTHS), 4, 64)
    exact = build_format_cache("float32", LENGTHS, 2, 64, 16, seed=5)
    want = backend.paged_decode_attention(q, exact.k_cache, exact.v_cache, exact.tables,
                                          exact.lens, 0.125, 1.0, 1.0, 130)
    for name in FORMATS:
        c = build_format_cache(name, LENGTHS, 2, 64, 16, seed=5)
        got = backend.paged_decode_attention(q, c.k_cache, c.v_cache, c.tables, c.lens, 0.125,
                                             c.k_scale, c.v_scale, 130)
        err = (got - want).abs().max().item()
        assert 10 * ATOL < err < 1.5, name


def test_declines_what_it_does_not_read():
    c = build_format_cache("kivi4", LENGTHS, 2, 64, 16)
    q = torch.randn(len(LENGTHS), 4, 64)
    args = (c.k_cache, c.v_cache, c.tables, c.lens, 0.125, c.k_scale, c.v_scale, 130)
    assert cpu_formats.decode_attention(q.bfloat16(), *args) is None  # a 16-bit model
    assert cpu_formats.decode_attention(q.transpose(0, 1).contiguous().transpose(0, 1),
                                        *args) is None
    c.k_scale.residual = c.k_scale.residual.double()
    assert cpu_formats.decode_attention(q, *args) is None


def test_bad_tables_and_residual_rows_raise_before_anything_is_read():
    c = build_format_cache("kivi2", [37], 2, 64, 16)
    q = torch.randn(1, 2, 64)
    args = (q, c.k_cache, c.v_cache, c.tables, c.lens, 0.125, c.k_scale, c.v_scale, 37)
    c.tables[0, 1] = c.k_cache.shape[0]
    with pytest.raises(IndexError, match="outside the pool"):
        cpu_formats.decode_attention(*args)
    c.tables[0, 1] = 0
    b, first, row, n = c.k_scale.plan.open_groups[0]
    c.k_scale.plan.open_groups[0] = (b, first, c.k_scale.residual.shape[0] - 1, n)
    with pytest.raises(IndexError, match="residual row"):
        cpu_formats.decode_attention(*args)
