"""The quantized KV formats in the engine: a prefix hit gives the tokens a cold run gives (the
quantization is a function of a block's own tokens), the 32-bit format is the unquantized path,
the pool's bytes are the formula's, and the format is part of a block's identity."""

from __future__ import annotations

import os

import pytest
import torch
from kv_bytes_by_hand import HAND, HAND_VALUES
from model_testutil import BlockAllocator, PagedSeq, greedy_decode, random_prompt

from kvscope.engine import Engine, EngineConfig, SamplingParams
from kvscope.engine.model_runner import ModelRunner
from kvscope.engine.models.load import load_model
from kvscope.kernels.kv_formats import QUANTIZED_FORMATS
from kvscope.lab import capacity as cap

SPEC = "llama3_rope_gqa_tied"  # 2 layers, 2 KV heads, head_dim 16
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(tiny_model_dir(SPEC))


def engine(loaded, fmt, prefix=True, **kw):
    return Engine(loaded, EngineConfig(block_size=8, num_blocks=48, kv_cache_dtype=fmt,
                                       enable_prefix_caching=prefix, **kw))


@pytest.mark.parametrize("fmt", ["fp8", *QUANTIZED_FORMATS])
def test_a_prefix_hit_gives_the_tokens_of_a_cold_run(loaded, fmt):
    """The second prompt hits 5 blocks of the first request; its last hit block was
    completed by decode steps (for KIVI: its last K group went through the residual)."""
    prompt = random_prompt(37, seed=5)
    runs = []
    for prefix in (True, False):
        e = engine(loaded, fmt, prefix)
        first = e.generate([prompt], PARAMS)[0].token_ids
        second = e.generate([prompt + first[:6]], PARAMS)[0]
        runs.append((first, second.token_ids, second.num_cached_tokens))
    assert runs[0][:2] == runs[1][:2]
    assert (runs[0][2], runs[1][2]) == (40, 0)


def test_the_formats_do_quantize(loaded):
    """Logits of one prompt per format, against the float32 cache's: the error grows as bits
    go (a check that the packed path runs at all), and kivi2 is not float32."""
    prompt = random_prompt(30, seed=6)

    def logits(fmt):
        r = ModelRunner(loaded, 8, 8, fmt)
        from model_testutil import BlockAllocator, PagedSeq
        return r.run([PagedSeq(prompt, BlockAllocator(8), 8).chunk()])[0]

    exact = logits("float32")
    err = {f: (logits(f) - exact).abs().max().item() for f in
           ("int8_per_token_head", "int4_per_token_head", "kivi4", "kivi2")}
    assert 0 < err["int8_per_token_head"] < err["int4_per_token_head"]
    assert err["kivi4"] < err["kivi2"]


def test_float32_is_the_unquantized_path(loaded):
    prompt = random_prompt(30, seed=7)
    outs = [engine(loaded, f).generate([prompt], PARAMS)[0] for f in ("auto", "float32")]
    assert outs[0].token_ids == outs[1].token_ids
    e = engine(loaded, "float32")
    assert e.runner.kv_meta == () and e.runner.residual is None
    assert e.cache_identity == f"{loaded.fingerprint}/torch.float32"  # hashes as before


def test_the_format_is_part_of_a_blocks_identity(loaded):
    ids = {f: engine(loaded, f).cache_identity for f in ("float32", *QUANTIZED_FORMATS)}
    assert len(set(ids.values())) == len(ids)
    assert ids["kivi4"].endswith("/kivi4/g8")


def test_host_tier_and_cow_keep_scales_with_the_blocks(loaded):
    """n = 2 forks a partial block (copy-on-write of its KIVI residual) and a host tier
    reloads evicted blocks with their scales: tokens equal a run without either."""
    prompt = random_prompt(29, seed=8)
    for fmt in ("int4_per_token_head", "kivi2"):
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=2)
        plain = engine(loaded, fmt, False).generate([prompt], params)
        forked = engine(loaded, fmt).generate([prompt], params)
        assert [o.token_ids for o in plain] == [o.token_ids for o in forked]
        small = Engine(loaded, EngineConfig(block_size=8, num_blocks=8, kv_cache_dtype=fmt,
                                            host_blocks=16))
        one = small.generate([prompt], PARAMS)[0].token_ids
        small.generate([random_prompt(40, seed=9)], PARAMS)  # evicts the first to the host
        again = small.generate([prompt], PARAMS)[0]
        assert again.token_ids == one and small.counters().num_loaded_blocks > 0


@pytest.mark.parametrize("dims", list(HAND))
def test_bytes_per_token_by_hand(dims):
    layers, heads, head_dim = dims
    shape = cap.KVShape(layers, heads * 3, heads, head_dim, "bfloat16")
    assert list(HAND[dims].values()) == HAND_VALUES[dims]
    for fmt, expect in HAND[dims].items():
        assert cap.kv_bytes_per_token(shape, fmt, 16) == expect, fmt
    residual = cap.format_residual_bytes(shape, "kivi4", 16)
    assert residual == layers * 15 * heads * head_dim * 2  # 15 tokens of bf16 K per layer
    assert cap.format_residual_bytes(shape, "int4_per_token_head") == 0
    memory = 2**30
    assert cap.tokens_that_fit(memory, shape, "kivi2", num_seqs=4) == \
        (memory - 4 * residual) // HAND[dims]["kivi2"]


@pytest.mark.parametrize("fmt", ["float32", "fp8", *QUANTIZED_FORMATS])
def test_the_pool_holds_the_formula_bytes(loaded, fmt):
    r = ModelRunner(loaded, 6, 16, fmt)
    tensors = (r.kv_cache, *r.kv_meta)
    per_block = sum(t.numel() * t.element_size() for t in tensors) // 6
    shape = cap.KVShape.from_model_config(loaded.config)
    assert per_block == r.kv_bytes_per_block
    assert r.kv_bytes_per_token == cap.kv_bytes_per_token(shape, fmt, 16)
    assert r.residual_bytes == 64 * cap.format_residual_bytes(shape, fmt, 16)


def test_bad_formats_are_refused(loaded):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int3")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="triton on the CPU needs TRITON_INTERPRET=1 (tests/conftest.py)")
@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
def test_triton_kernels_give_the_torch_paths_tokens(loaded, fmt):
    """Chunked prefill (the second chunk starting mid KIVI group), a step mixing prefill and
    decode, then batched greedy decode past group and block edges: the triton kernels
    (interpreted) give the torch kernels' tokens and, within float32 rounding, their logits.
    fp8_per_head with calibrated (unequal) per-head scales."""
    pytest.importorskip("triton")
    prompts = [random_prompt(13, seed=4), random_prompt(6, seed=5)]
    runs = []
    for impl in ("torch", "triton"):
        runner = ModelRunner(loaded, 24, 8, fmt, kernel_impl=impl)
        if fmt == "fp8_per_head":
            runner.calibrate_kv_scales(prompts)
        alloc = BlockAllocator(24, seed=3)
        a, b = (PagedSeq(p, alloc, 8) for p in prompts)
        runner.run([a.chunk(5, want_logits=False)])
        first = runner.run([a.chunk(), b.chunk()])
        runs.append(greedy_decode(runner, [a, b], first, 6))
    (want_tokens, want_logits), (tokens, logits) = runs
    assert tokens == want_tokens
    for ours, ref in zip(logits, want_logits, strict=True):
        assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("fmt", ["bfloat16", "fp8", *QUANTIZED_FORMATS])
def test_decode_steps_in_c_equal_the_torch_kernels(loaded, fmt, monkeypatch):
    """Two sequences (one ending inside an open KIVI group) decoding the same forced tokens on
    the "cpu" kernels and on the torch ones: the same logits every step, and the "cpu" runner's
    decode attention never falls back to the reference. Tolerance: the kernels differ by
    float32 rounding (tests/kernels/test_kernels_cpu_formats.py), but the K/V a step stores
    comes from that step's attention, and a value that lands on the other side of a rounding
    boundary of the format (one bfloat16 ulp, one int4 step) carries it on: 2.8e-4 seen here,
    against 2.6e-3 (bfloat16) to 0.4 (kivi2) between a format's logits and float32's."""
    from kvscope.kernels import reference

    prompts = [random_prompt(21, seed=8), random_prompt(34, seed=9)]
    forced = random_prompt(10, seed=10)
    runs = {}
    for impl in ("torch", "cpu"):
        runner = ModelRunner(loaded, 16, 8, fmt, kernel_impl=impl)
        alloc = BlockAllocator(16)
        seqs = [PagedSeq(p, alloc, 8) for p in prompts]
        runner.run([s.chunk() for s in seqs])
        if impl == "cpu":
            monkeypatch.setattr(reference, "paged_decode_attention", None)  # a fallback raises
        steps = []
        for tok in forced:
            for s in seqs:
                s.tokens.append(tok)
            steps.append(runner.run([s.chunk() for s in seqs]))
        runs[impl] = torch.stack(steps)
    torch.testing.assert_close(runs["cpu"], runs["torch"], atol=1e-3, rtol=1e-3)
