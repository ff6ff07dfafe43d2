"""The runner computes maximum lengths on the host, and a forward through the triton kernels
reads nothing back from the device (on a GPU each read would stall the host once per layer)."""

from __future__ import annotations

import os

import pytest
import torch
from model_testutil import BlockAllocator, PagedSeq, random_prompt

from kvscope import kernels
from kvscope.engine.host_sync import HostSyncError, no_host_sync
from kvscope.engine.model_runner import ModelRunner, SeqChunk
from kvscope.engine.models.load import load_model


@pytest.fixture
def runner(tiny_model_dir):
    impl = "triton" if os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    return ModelRunner(load_model(tiny_model_dir("llama3_rope_gqa_tied")), num_blocks=32,
                       block_size=4, kernel_impl=impl)


def test_context_of_a_mixed_batch_carries_host_maxima(runner):
    chunks = [SeqChunk([5, 6, 7], start_pos=4, block_table=[9, 3]),        # 3 new over 4 cached
              SeqChunk([8], start_pos=12, block_table=[1, 2, 4, 5]),      # decode at 13
              SeqChunk([9] * 6, start_pos=0, block_table=[7, 8], want_logits=False)]
    batch = runner.prepare(chunks)
    ctx = batch.ctx
    assert (ctx.max_seqlen_q, ctx.max_seqlen_k) == (6, 13)
    assert isinstance(ctx.max_seqlen_q, int) and isinstance(ctx.max_seqlen_k, int)
    assert not ctx.is_decode
    assert ctx.context_lens.tolist() == [7, 13, 6]
    assert ctx.cu_seqlens_q.tolist() == [0, 3, 4, 10]
    assert ctx.block_tables.dtype == torch.int32 and ctx.block_tables.shape == (3, 4)
    assert batch.logit_rows.tolist() == [2, 3]  # the last token of the chunks wanting logits
    assert ctx.kernels is runner.kernels


def test_context_of_a_decode_batch(runner):
    batch = runner.prepare([SeqChunk([1], 7, [0, 1]), SeqChunk([2], 2, [5])])
    assert batch.ctx.is_decode and (batch.ctx.max_seqlen_q, batch.ctx.max_seqlen_k) == (1, 8)


def test_backend_is_chosen_once_for_the_device(tiny_model_dir):
    loaded = load_model(tiny_model_dir("llama3_rope_gqa_tied"))
    assert ModelRunner(loaded, 4, 4).kernels.name == "cpu"  # CPU default: C kernels + torch
    with pytest.raises(ValueError, match="impl must be"):
        ModelRunner(loaded, 4, 4, kernel_impl="cuda")


def test_the_detector_catches_a_launcher_that_reads_lengths_back():
    lens = torch.tensor([3, 9], dtype=torch.int32)
    q = torch.randn(2, 2, 8)
    cache = torch.randn(4, 4, 1, 8)
    tables = torch.tensor([[0, 1, 2], [3, 0, 0]], dtype=torch.int32)
    with no_host_sync("cpu"), pytest.raises(HostSyncError, match="tolist"):
        kernels.paged_decode_attention(q, cache, cache, tables, lens, 0.3, impl="torch")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="triton on the CPU needs TRITON_INTERPRET=1 (tests/conftest.py)")
def test_triton_forward_reads_nothing_back(runner):
    alloc = BlockAllocator(32, seed=2)
    a, b = (PagedSeq(random_prompt(n, seed=n), alloc, 4) for n in (11, 5))
    with no_host_sync("cpu"):
        runner.run([a.chunk(6, want_logits=False)])           # prefill
        runner.run([a.chunk(), b.chunk()])                   # prefill over a cached prefix
        for s in (a, b):
            s.tokens.append(7)  # sampling (one transfer per step) is the engine's, not tested here
        runner.run([a.chunk(), b.chunk()], copies=[(a.table[0], 30)])  # decode with a copy
