"""The paged runner gives the same logits and greedy tokens however the work is split:
prefix-cache hit vs miss, copy-on-write, chunked prefill, batching, and the no-cache baseline."""

from __future__ import annotations

import pytest
import torch
from model_testutil import LOGIT_ATOL, BlockAllocator, PagedSeq, greedy_decode, random_prompt

from kvscope.engine.model_runner import ModelRunner, SeqChunk
from kvscope.engine.models.load import load_model

BLOCK_SIZE = 8
NUM_BLOCKS = 64
STEPS = 24
SPECS = ["llama3_rope_gqa_tied", "qwen3_headdim", "mistral_mqa"]


@pytest.fixture(params=SPECS)
def loaded(request, tiny_model_dir):
    return load_model(tiny_model_dir(request.param))


def new_runner(loaded) -> ModelRunner:
    return ModelRunner(loaded, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    diff = (a - b).abs().max().item()
    assert diff <= LOGIT_ATOL, f"{what}: max abs logit diff {diff}"


def assert_same_run(a, b) -> None:
    """Both are (tokens, logits per step) from greedy_decode."""
    assert a[0] == b[0]
    for step, (x, y) in enumerate(zip(a[1], b[1], strict=True)):
        assert_close(x, y, f"step {step}")


def reference(loaded, prompt, steps=STEPS, seed=3):
    """One sequence, whole prompt in one chunk, its own fresh runner."""
    runner = new_runner(loaded)
    seq = PagedSeq(prompt, BlockAllocator(NUM_BLOCKS, seed), BLOCK_SIZE)
    return greedy_decode(runner, [seq], runner.run([seq.chunk()]), steps)


def test_prefix_cache_hit_matches_miss(loaded):
    shared = random_prompt(5 * BLOCK_SIZE + 3, seed=10)
    prompt_b = shared[:5 * BLOCK_SIZE] + random_prompt(11, seed=11)
    runner = new_runner(loaded)
    alloc = BlockAllocator(NUM_BLOCKS, seed=5)

    a = PagedSeq(shared, alloc, BLOCK_SIZE)
    greedy_decode(runner, [a], runner.run([a.chunk()]), 6)  # a keeps decoding into its tail

    k = 4  # reuse a's first 4 full blocks; compute only the rest of b
    b = PagedSeq(prompt_b, alloc, BLOCK_SIZE, shared_blocks=a.table[:k], num_cached=k * BLOCK_SIZE)
    first = b.chunk()
    assert first.start_pos == 32 and len(first.token_ids) == len(prompt_b) - 32
    hit = greedy_decode(runner, [b], runner.run([first]), STEPS)
    assert_same_run(hit, reference(loaded, prompt_b))


def test_copy_on_write_of_a_partial_block(loaded):
    prompt = random_prompt(3 * BLOCK_SIZE + 5, seed=20)  # last block is partial
    runner = new_runner(loaded)
    alloc = BlockAllocator(NUM_BLOCKS, seed=6)
    a = PagedSeq(prompt, alloc, BLOCK_SIZE)
    logits_a = runner.run([a.chunk()])

    # b forks after the whole prompt: shares the full blocks, copies the partial one.
    cow = alloc.take()
    b = PagedSeq(prompt, alloc, BLOCK_SIZE, shared_blocks=a.table[:3] + [cow],
                 num_cached=len(prompt))
    b.tokens.append(7)
    a.tokens.append(9)  # a's next token differs and lands in a's own partial block
    logits = runner.run([a.chunk(), b.chunk()], copies=[(a.table[3], cow)])

    ref_b = new_runner(loaded).run_naive([prompt + [7]])
    ref_a = new_runner(loaded).run_naive([prompt + [9]])
    assert_close(logits[1], ref_b[0], "b after copy-on-write")
    assert_close(logits[0], ref_a[0], "a after b's fork")
    assert_close(logits_a[0], new_runner(loaded).run_naive([prompt])[0], "a prefill")


def test_chunked_prefill_matches_one_shot(loaded):
    prompt = random_prompt(51, seed=30)
    runner = new_runner(loaded)
    seq = PagedSeq(prompt, BlockAllocator(NUM_BLOCKS, seed=8), BLOCK_SIZE)
    sizes = [7, 13, 1, 9, 21]  # odd sizes across block boundaries, one single-token chunk
    assert sum(sizes) == len(prompt)
    for n in sizes[:-1]:
        out = runner.run([seq.chunk(n, want_logits=False)])
        assert out.shape == (0, loaded.config.vocab_size)
    chunked = greedy_decode(runner, [seq], runner.run([seq.chunk(sizes[-1])]), STEPS)
    assert_same_run(chunked, reference(loaded, prompt))


def test_batched_matches_one_at_a_time(loaded):
    prompts = [random_prompt(n, seed=n) for n in (5, 23, 17, 8)]
    runner = new_runner(loaded)
    alloc = BlockAllocator(NUM_BLOCKS, seed=9)
    seqs = [PagedSeq(p, alloc, BLOCK_SIZE) for p in prompts]
    first = runner.run([s.chunk() for s in seqs])
    assert first.shape == (4, loaded.config.vocab_size)
    tokens, logits = greedy_decode(runner, seqs, first, STEPS)
    for i, p in enumerate(prompts):
        alone = reference(loaded, p)
        assert tokens[i] == alone[0][0]
        for step, (x, y) in enumerate(zip(logits, alone[1], strict=True)):
            assert_close(x[i], y[0], f"seq {i} step {step}")


def test_mixed_prefill_and_decode_in_one_step(loaded):
    """A decoding sequence and a prefilling one share a forward (the prefill path)."""
    p1, p2 = random_prompt(12, seed=40), random_prompt(19, seed=41)
    runner = new_runner(loaded)
    alloc = BlockAllocator(NUM_BLOCKS, seed=10)
    s1 = PagedSeq(p1, alloc, BLOCK_SIZE)
    tok = int(runner.run([s1.chunk()])[0].argmax())
    s1.tokens.append(tok)
    s2 = PagedSeq(p2, alloc, BLOCK_SIZE)
    logits = runner.run([s2.chunk(10, want_logits=False), s1.chunk(), s2.chunk(9)])
    assert logits.shape[0] == 2  # s2's first chunk asked for none
    naive = new_runner(loaded).run_naive([p1 + [tok], p2])
    assert_close(logits[0], naive[0], "decoding sequence")
    assert_close(logits[1], naive[1], "prefilling sequence")


def test_paged_greedy_matches_naive_recompute(loaded):
    prompt = random_prompt(14, seed=50)
    paged_tokens, paged_logits = reference(loaded, prompt, steps=64)
    runner = new_runner(loaded)
    seq, tokens = list(prompt), []
    for step in range(64):
        logits = runner.run_naive([seq])[0]
        assert_close(logits, paged_logits[step][0], f"step {step}")
        tokens.append(int(logits.argmax()))
        seq.append(tokens[-1])
    assert tokens == paged_tokens[0]


def test_kv_bytes_per_token_and_fp8(tiny_model_dir):
    loaded = load_model(tiny_model_dir("llama3_rope_gqa_tied"))
    cfg = loaded.config
    per_elem = {"auto": 4, "float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
    for name, size in per_elem.items():
        r = ModelRunner(loaded, num_blocks=8, block_size=BLOCK_SIZE, kv_cache_dtype=name)
        assert r.kv_bytes_per_token == cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * size
        assert r.kv_cache.shape == (cfg.num_layers, 2, 8, BLOCK_SIZE, cfg.num_kv_heads,
                                    cfg.head_dim)

    prompt = random_prompt(30, seed=60)
    exact = new_runner(loaded).run_naive([prompt])[0]
    fp8 = ModelRunner(loaded, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, kv_cache_dtype="fp8")
    fp8.calibrate_kv_scales([prompt])
    assert all(s > 0 for s in fp8.k_scales + fp8.v_scales)
    seq = PagedSeq(prompt, BlockAllocator(NUM_BLOCKS), BLOCK_SIZE)
    approx = fp8.run([seq.chunk()])[0]
    assert torch.isfinite(approx).all()
    assert (approx - exact).abs().max().item() < 0.1 * exact.abs().max().item()
    with pytest.raises(RuntimeError, match="before anything is stored"):
        fp8.calibrate_kv_scales([prompt])


def test_bad_chunks_are_refused(tiny_model_dir):
    runner = new_runner(load_model(tiny_model_dir("llama_mha")))
    with pytest.raises(ValueError, match="cannot hold"):
        runner.run([SeqChunk(list(range(3, 20)), 0, [0, 1])])
    with pytest.raises(ValueError, match="out of range"):
        runner.run([SeqChunk([5], 0, [NUM_BLOCKS])])
    with pytest.raises(ValueError, match="at least one"):
        runner.run([SeqChunk([], 0, [0])])
