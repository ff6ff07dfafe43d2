"""The experiments' arithmetic on synthetic numbers with known answers: fits, ratios, settling,
ideal lines, capacity, and each verdict built from rows a fake clock would give."""

import pytest
from kv_bytes_by_hand import HAND

from kvscope.lab.capacity import FORMATS, KVShape, kv_bytes_per_token
from kvscope.lab.experiments import (
    block_size,
    capacity,
    fp8,
    lengths,
    naive,
    offload,
    warm_prefix,
    warmup,
)
from kvscope.lab.experiments.fit import (
    ideal_warm,
    linear_fit,
    quadratic_fit,
    ratio,
    requests_that_fit_in_blocks,
    settled_after,
    spread,
)


def test_linear_fit_recovers_a_line_exactly():
    fit = linear_fit([1, 2, 3, 4], [5, 7, 9, 11])
    assert fit.coef == pytest.approx((3, 2))
    assert fit.r2 == pytest.approx(1.0)


def test_quadratic_fit_recovers_a_parabola_and_beats_a_line_on_it():
    xs = list(range(10))
    ys = [1 + 0.5 * x + 2 * x * x for x in xs]
    quad, lin = quadratic_fit(xs, ys), linear_fit(xs, ys)
    assert quad.coef == pytest.approx((1, 0.5, 2))
    assert quad.r2 == pytest.approx(1.0)
    assert lin.r2 < 0.97


def test_r2_of_a_noisy_line_is_below_one():
    fit = linear_fit([0, 1, 2, 3], [0, 2, 1, 3])
    assert fit.coef == pytest.approx((0.3, 0.8))
    assert fit.r2 == pytest.approx(0.64)


def test_a_fit_needs_distinct_points():
    with pytest.raises(ValueError, match="distinct"):
        linear_fit([2, 2, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="more than 2 points"):
        quadratic_fit([1, 2], [1, 2])


def test_ratio_spread_and_ideal():
    assert ratio(25, 2.5) == 10
    assert ratio(1, 0) == float("inf")
    assert spread([9, 10, 12]) == pytest.approx(0.2)
    assert ideal_warm(100, 0.75) == pytest.approx(25)


def test_settled_after_counts_the_slow_first_requests():
    assert settled_after([300, 150, 101, 100, 99, 100, 102]) == 2
    assert settled_after([100, 100, 100]) == 0
    assert settled_after([1, 100, 1, 100, 1]) is None


def test_paged_capacity_rounds_each_request_up_to_whole_blocks():
    assert requests_that_fit_in_blocks(64, 32, 16) == 32
    assert requests_that_fit_in_blocks(64, 33, 16) == 21  # 3 blocks each


def test_llama_3_1_8b_holds_128_kib_per_token_in_16_bit_and_half_in_fp8():
    llama = KVShape(num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)
    assert kv_bytes_per_token(llama, "bfloat16") == 128 * 1024
    assert kv_bytes_per_token(llama, "fp8") == 64 * 1024
    assert capacity.pool_blocks(2**30, 128 * 1024) == 512


def test_naive_verdict_from_a_fake_clock():
    # naive step i over 100 + i tokens takes 0.1 ms per token; cached steps take 1 ms flat
    rows = [[i, 100 + i, 0.1 * (100 + i), 1.0] for i in range(20)]
    totals = {"naive": sum(r[2] for r in rows), "cached": sum(r[3] for r in rows)}
    r = naive.summarize(rows, totals, 100, 20)
    assert r.verdict.startswith("measured 11.0x")
    assert "+10 ms per 100 tokens without a cache, +0 with one" in r.verdict
    assert r.column("naive ms") == [r[2] for r in rows]


def test_prompt_length_verdict_from_a_fake_clock():
    rows = [[p, 8, 2 + 0.05 * p, 4.0, 0.0] for p in (100, 200, 400)]
    rows[2][3] = 5.0
    r = lengths.summarize_prompt(rows)
    assert "TTFT grows 50 ms per 1,000 prompt tokens (linear fit R^2 1.000" in r.verdict
    assert "within 25 % of its median 4 ms" in r.verdict


def test_output_length_verdict_from_a_fake_clock():
    rows = [[16, o, 3.0, 2.0, 3 + 2 * o] for o in (10, 20, 40)]
    r = lengths.summarize_output(rows)
    assert "total time grows 2 ms per output token (linear fit R^2 1.000" in r.verdict
    assert "TTFT stays within 0 %" in r.verdict


def test_warm_prefix_verdict_against_the_ideal_line():
    # 10 ms fixed + 90 ms per uncached prompt: 100 ms cold, 19 ms at 90 % cached
    measured = [(f, f, 10 + 90 * (1 - f)) for f in (0, 0.25, 0.5, 0.75, 0.9)]
    r = warm_prefix.summarize(measured)
    assert r.column("ideal ms") == pytest.approx([100, 75, 50, 25, 10])
    assert "from 100 ms cold to 19 ms with 90 % cached (5.3x" in r.verdict
    assert "fixed overhead (fit at 100 % cached) 10 ms, R^2 1.000" in r.verdict


def test_warm_up_verdict_counts_requests_before_settling():
    totals = [50, 30, 20, 20.5, 19.8, 20, 20.1]
    r = warmup.summarize([[i + 1, 1.0, t] for i, t in enumerate(totals)])
    assert r.verdict == ("the first request took 50 ms, 2.5x the median 20.1 ms; settled within "
                         "5 % of the median after 2 requests")


@pytest.mark.parametrize("dims", list(HAND))
def test_capacity_plans_every_format_by_the_hand_numbers(dims):
    layers, heads, head_dim = dims
    shape = KVShape(layers, heads * 3, heads, head_dim, "bfloat16")
    budget, context = 2**30, 4096  # 256 blocks of 16 tokens per request
    planned = {fmt: row for label, fmt, *row in capacity.plan(shape, budget, context)}
    assert set(planned) == set(HAND[dims]) == {f for _, f in FORMATS}
    residual = layers * 15 * heads * head_dim * 2  # KIVI: 15 tokens of bf16 K per layer
    for fmt, (per_token, res, blocks, fit) in planned.items():
        assert per_token == HAND[dims][fmt], fmt
        assert res == (residual if fmt.startswith("kivi") else 0), fmt
        assert fit == budget // (context * per_token + res), fmt
        assert blocks == (budget - fit * res) // (16 * per_token), fmt


def test_capacity_verdict_compares_every_format_to_16_bit():
    def row(name, per_token, residual, blocks, fit, running, engine=None):
        return [name, per_token, residual, blocks, blocks * 16, engine or per_token, residual,
                0, fit, running, 0, -1, 0]

    rows = [row("16-bit", 2048, 0, 16, 8, 8), row("fp8", 1024, 0, 32, 16, 16),
            row("kivi2", 448, 30720, 26, 11, 11)]
    r = capacity.summarize(rows, 512 * 1024, 32)
    assert "16-bit 2,048 B/token -> 256 tokens (1.00x), formula 8, measured up to 8" in r.verdict
    assert "fp8 1,024 B/token -> 512 tokens (2.00x), formula 16, measured up to 16" in r.verdict
    assert "kivi2 448 B/token + 30,720 B residual/request -> 416 tokens (1.62x)" in r.verdict
    assert r.verdict.endswith("the engine's tensors hold the formula's bytes in every format")
    rows[2] = row("kivi2", 448, 30720, 26, 11, 11, engine=450)
    assert capacity.summarize(rows, 512 * 1024, 32).verdict.endswith("formula in kivi2")


def test_fp8_agreement_and_verdict():
    assert fp8.agreement([1, 2, 3, 4], [1, 2, 9, 4]) == (3, 2)
    assert fp8.agreement([1, 2], [1, 2]) == (2, None)
    r = fp8.summarize([[0, 4, 3, 2, 0.5], [1, 4, 4, -1, 0.25]], 2048, 1024)
    assert r.verdict.endswith("1/2 prompts identical; largest logit deviation 0.5")
    assert "capacity 2.0x" in r.verdict
    assert "agree at 7/8 positions (88 %), 1/2 prompts" in r.verdict


def test_block_size_whole_blocks_only():
    assert block_size.ideal_hit_tokens(200, 16) == 192
    assert block_size.ideal_hit_tokens(200, 64) == 192
    assert block_size.ideal_hit_tokens(200, 128) == 128
    r = block_size.summarize([[8, 400, 400, 1.0, 2.0], [64, 384, 384, 1.0, 1.5]], 200, 3)
    assert "reused 400 tokens at block size 8 and 384 at 64" in r.verdict


def test_offload_crossing_is_where_loading_starts_to_win_for_good():
    lengths = [16, 32, 64, 128]
    recompute = [2.0, 3.0, 5.0, 9.0]
    assert offload.crossing(lengths, recompute, [3.0, 3.5, 4.0, 5.0]) == 64
    assert offload.crossing(lengths, recompute, [1.5, 3.5, 4.0, 5.0]) == 64  # a lone early win
    assert offload.crossing(lengths, recompute, [1.0, 2.0, 3.0, 4.0]) == 16
    assert offload.crossing(lengths, recompute, [3.0, 3.5, 4.0, 9.0]) is None  # a tie at the end
    assert offload.crossing(lengths, recompute, [3.0, 4.0, 6.0, 10.0]) is None


def test_offload_verdict_names_the_crossing_or_its_absence():
    rows = [[n, 0, n, n, cold, 1.0, host, 0.5] for n, cold, host in
            ((16, 2.0, 3.0), (32, 3.0, 3.5), (64, 5.0, 4.0), (128, 9.0, 5.0))]
    r = offload.summarize(rows)
    assert r.verdict == ("on this machine (cpu), loading a prefix of >= 64 tokens back from the "
                         "host tier is faster than recomputing it: 4 ms vs 5 ms at 64; at 128 "
                         "tokens: recompute 9 ms, host 5 ms (load 0.5 ms), device 1 ms")
    slow = [row[:6] + [row[4] + 1, 0.5] for row in rows]
    assert offload.summarize(slow, "cuda").verdict.startswith(
        "on this machine (cuda), no crossing in the range measured (16-128 tokens)")


def test_offload_lengths_reach_the_context_in_whole_blocks():
    assert offload.prefix_lengths(2048, quick=False) == [16, 32, 64, 128, 256, 512, 1024, 2032]
    assert offload.prefix_lengths(100, quick=False) == [16, 32, 64, 80]
    assert offload.prefix_lengths(131072, quick=False)[-2:] == [4096, 8192]
    assert offload.prefix_lengths(2048, quick=True) == [32, 64, 128]


def test_result_table_and_csv():
    r = warmup.summarize([[1, 1.0, 2.0], [2, 1.0, 2.0], [3, 1.0, 2.0]])
    assert r.to_csv().splitlines()[0] == "request,TTFT ms,total ms"
    assert r.table().splitlines()[1].split() == ["1", "1", "2"]
    assert type(r).from_dict(r.to_dict()) == r
