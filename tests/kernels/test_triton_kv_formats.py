"""The triton kernels on the formats with per-head or per-token scales (fp8_per_head,
int8/int4_per_token_head, kivi4/kivi2) against the torch reference, under TRITON_INTERPRET=1 on
a CPU machine: the same passes (prefills over cached prefixes, a chunk starting mid KIVI group,
batched decode steps) run on each backend's own cache, which must end byte for byte equal, and
each pass's attention output must equal the reference's dequantize-then-attend."""

from __future__ import annotations

import pytest
import torch
from gpucheck.kv_passes import World, passes

pytest.importorskip("triton")

FORMATS = ["fp8_per_head", "int8_per_token_head", "int4_per_token_head", "kivi4", "kivi2"]
# Attention output, float32 model: both read the same quantized values, so only float32 rounding
# differs: int8/int4 scale the scores and softmax weights instead of the tile (as vLLM), int4
# rotates the queries and the output instead of K and V (a b-term sum each), softmax online.
# A code off by one moves an output by ~1e-2; the observed differences are ~1e-6.
F32_ATOL = 2e-5
# A float16 model (fp8_per_head's, and one KIVI case): the output's float16 rounding on top.
F16_ATOL, F16_REL = 1e-3, torch.finfo(torch.float16).eps


def fp8_scales(kv_heads):
    """Per KV head, far apart (a head's scale applied to another head shows)."""
    return (torch.linspace(0.5, 0.02, kv_heads)[:, None],
            torch.linspace(0.25, 0.01, kv_heads)[:, None])


def assert_close(got, want, name):
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.float(), want.float()
    f16 = got.dtype == torch.float16
    bound = F16_ATOL + F16_REL * w.abs() if f16 else torch.full_like(w, F32_ATOL)
    err = (g - w).abs()
    assert (err <= bound).all(), f"{name}: max err {err.max():.3g}"


def assert_same_state(ref: World, tri: World):
    if ref.fmt.name == "fp8_per_head":  # -0.0 and +0.0 below the smallest subnormal: as values
        assert torch.equal(ref.cache.float(), tri.cache.float())
    else:
        assert torch.equal(ref.cache, tri.cache)
    for a, b in zip(ref.meta, tri.meta, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if ref.residual is not None:
        assert torch.equal(ref.residual.k, tri.residual.k)


def run_both(name, schedule, heads, kv_heads, head_dim, block_size, seed=0, dtype=None,
             **attend):
    num_blocks = 24
    dtype = dtype or (torch.float16 if name == "fp8_per_head" else torch.float32)
    scales = fp8_scales(kv_heads) if name == "fp8_per_head" else (1.0, 1.0)
    worlds = [World.make(impl, name, num_blocks, block_size, kv_heads, head_dim, dtype,
                         scales=scales) for impl in ("torch", "triton")]
    for p in passes(schedule, heads, kv_heads, head_dim, block_size, num_blocks, dtype, seed):
        want, got = (w.run(p, **attend) for w in worlds)
        assert_close(got, want, name)
    assert_same_state(*worlds)
    return worlds


# Two sequences: prompts of 37 and 20 tokens; a 5-token chunk of the first (starting mid KIVI
# group: its first keys come from the residual); two batched decode steps.
SCHEDULE = [[37, 20], [5, 0], [1, 1], [1, 1]]


# The interpreter's warning of a product of garbage (a read out of bounds); padded query rows
# of a window that sees no key divide by zero harmlessly (their output is not stored).
NO_GARBAGE = pytest.mark.filterwarnings("error:.* in matmul:RuntimeWarning")


@NO_GARBAGE
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", FORMATS)
def test_triton_matches_reference_on_each_format(name, head_dim):
    run_both(name, SCHEDULE, 4, 2, head_dim, 16)


@NO_GARBAGE
@pytest.mark.parametrize("name", FORMATS)
def test_sliding_window_softcap_and_wider_gqa(name):
    """Block 8 (KIVI groups of 8), 8 query heads per KV head, a 10-token window (keys before it
    unread), soft-capping and 3 decode splits."""
    run_both(name, [[30, 3], [1, 1], [1, 1]], 8, 1, 64, 8, seed=1, window=10, softcap=5.0,
             num_splits=3)


@NO_GARBAGE
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kivi_group_completed_and_reopened_in_one_block(dtype):
    """Block 32 holds two KIVI groups of 16: the chunk 40..51 completes the group 32..47 (its
    first 8 keys from the residual) and opens 48.. in the same block, whose residual slot it
    takes over; queries 40..46 must still read 32..39 in full precision (a float16 model:
    those keys in float16)."""
    ref, tri = run_both("kivi2", [[40], [12], [1]], 4, 2, 64, 32, seed=2, dtype=dtype)
    assert ref.fmt.group == 16 and len(tri.outputs) == 3

