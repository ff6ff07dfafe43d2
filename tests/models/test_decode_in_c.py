"""A float32 CPU decode step runs every decoder layer in one C call (``cpu.DecoderWeights``,
``LlamaForCausalLM._decode_in_c``): the same kernels in the same order as the layers' own
forwards, so its logits must equal the per-op path's exactly (up to LINEAR_MAX_ROWS rows; with
more, that path's products are torch's), for every architecture flag
(biases, q/k norms, GQA and MQA, head_dim != hidden / heads), and it must step aside where it
does not apply (Gemma's layers among them: test_gemma.py)."""

from __future__ import annotations

import pytest
import torch
from model_testutil import (
    GEMMA,
    LOGIT_ATOL,
    MODEL_SPECS,
    BlockAllocator,
    PagedSeq,
    greedy_decode,
    random_prompt,
)

from kvscope.engine.model_runner import ModelRunner
from kvscope.engine.models.llama import LlamaForCausalLM
from kvscope.engine.models.load import load_model
from kvscope.kernels import cpu

BLOCK_SIZE = 8
NUM_BLOCKS = 64


class Taken:
    """Wraps ``_decode_in_c`` to note what each call returned; ``per_op`` forces the layers'
    own forwards instead."""

    def __init__(self, monkeypatch, per_op: bool = False):
        self.results: list[bool] = []
        real = LlamaForCausalLM._decode_in_c

        def spy(model, *args):
            taken = False if per_op else real(model, *args)
            self.results.append(taken)
            return taken

        monkeypatch.setattr(LlamaForCausalLM, "_decode_in_c", spy)


def decode(loaded, steps=10, lengths=(5, 17, 9), **runner_args):
    """Prefill sequences of ``lengths`` (shuffled blocks), then ``steps`` batched greedy
    decode steps; returns (tokens, logits per step)."""
    runner = ModelRunner(loaded, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, **runner_args)
    alloc = BlockAllocator(NUM_BLOCKS, seed=4)
    seqs = [PagedSeq(random_prompt(n, seed=n), alloc, BLOCK_SIZE) for n in lengths]
    return greedy_decode(runner, seqs, runner.run([s.chunk() for s in seqs]), steps)


# Gemma's layers, and models with two KV-cache groups (full and windowed layers: a table and a
# slot mapping per group), take the per-layer path by design.
TWO_GROUPS = ("qwen2_window_layers", "qwen3_layer_types", "ministral_layers")


@pytest.mark.parametrize(("spec", "threads", "batch"), [(s, 1, 3) for s in sorted(MODEL_SPECS)
                                                          if s not in (*GEMMA, *TWO_GROUPS)]
                         + [("llama_bias_gqa4", 2, 3),  # OpenMP splits the products' rows
                            ("qwen3_headdim", 1, cpu.MAX_ROWS)])  # the most rows it takes
def test_one_call_per_step_equals_the_layers_own_forwards(spec, threads, batch, tiny_model_dir,
                                                          monkeypatch):
    torch.set_num_threads(threads)  # (the suite's autouse fixture puts it back)
    loaded = load_model(tiny_model_dir(spec))
    lengths = (5, 17, 9) if batch == 3 else tuple(range(3, 3 + batch))
    with monkeypatch.context() as m:
        fused = Taken(m)
        tokens, logits = decode(loaded, lengths=lengths)
    with monkeypatch.context() as m:
        per_op = Taken(m, per_op=True)
        want_tokens, want_logits = decode(loaded, lengths=lengths)
    assert fused.results == [False] + [True] * 9  # the prefill, then every decode step
    assert per_op.results == [False] * 10
    assert tokens == want_tokens
    for step, (got, want) in enumerate(zip(logits, want_logits, strict=True)):
        if batch <= cpu.LINEAR_MAX_ROWS:  # the same kernels in the same order: bit for bit
            assert torch.equal(got, want), f"step {step}: {(got - want).abs().max().item()}"
        else:  # the per-op path's products are torch's there: another summation order
            torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=0)


def test_it_steps_aside_where_it_does_not_apply(tiny_model_dir, monkeypatch):
    loaded = load_model(tiny_model_dir("llama3_rope_gqa_tied"))
    cases = {
        "the pure torch reference kernels": dict(kernel_impl="torch"),
        "an fp8 KV cache": dict(kv_cache_dtype="fp8"),
        "a bfloat16 KV cache": dict(kv_cache_dtype="bfloat16"),
    }
    for what, runner_args in cases.items():
        with monkeypatch.context() as m:
            spy = Taken(m)
            decode(loaded, steps=3, **runner_args)
        assert spy.results == [False] * 3, what
    with monkeypatch.context() as m:  # more rows than the C products take
        spy = Taken(m)
        decode(loaded, steps=2, lengths=range(3, 3 + cpu.MAX_ROWS + 1))
    assert spy.results == [False] * 2
    with monkeypatch.context() as m:  # no compiler, or KVSCOPE_CPU_KERNELS=0
        m.setattr(cpu, "_lib", None)
        spy = Taken(m)
        decode(loaded, steps=2)
    assert spy.results == [False] * 2

    bf16 = load_model(tiny_model_dir("llama3_rope_gqa_tied"), dtype=torch.bfloat16)
    with monkeypatch.context() as m:
        spy = Taken(m)
        decode(bf16, steps=2)
    assert spy.results == [False] * 2


def test_moved_or_changed_weights_are_followed(tiny_model_dir, monkeypatch):
    """The C call holds raw pointers: a weight given new memory (``p.data = ...``, as
    ``hugepage_weights`` does) must be read from its new place, not the freed one."""
    loaded = load_model(tiny_model_dir("qwen2_gqa_tied"))
    decode(loaded, steps=2)  # builds the pointer table
    with torch.no_grad():
        for layer in loaded.model.model.layers:
            w = layer.mlp.down_proj.weight
            w.data = w.data * 1.5  # new memory, new values
    tokens, logits = decode(loaded, steps=4)
    with monkeypatch.context() as m:
        Taken(m, per_op=True)
        want_tokens, want_logits = decode(loaded, steps=4)
    assert tokens == want_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, want_logits, strict=True))


def test_bad_slots_and_tables_raise_before_anything_is_read(tiny_model_dir):
    loaded = load_model(tiny_model_dir("llama_mha"))
    model, cfg = loaded.model, loaded.config
    weights = model._decoder_weights()
    assert weights.usable
    cache = torch.zeros(cfg.num_layers, 2, 4, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    x = torch.randn(1, cfg.hidden_size)
    cos = sin = torch.ones(1, 1, cfg.head_dim)
    table, lens = torch.tensor([[0]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    with pytest.raises(IndexError, match="slot out of range"):
        weights.run(x, cos, sin, cache, torch.tensor([4 * BLOCK_SIZE]), table, lens)
    with pytest.raises(IndexError, match="block table"):
        weights.run(x, cos, sin, cache, torch.tensor([0]), torch.tensor([[7]], dtype=torch.int32),
                    lens)
    assert not weights.run(x, cos, sin, cache.half(), torch.tensor([0]), table, lens)
    assert weights.run(x, cos, sin, cache, torch.tensor([0]), table, lens)
