"""Each experiment end to end on the demo model at its quick size: the measured rows agree with
what the engine must do (whole-block hits, pool sizes, one row per step), progress reaches the
end, a cancel stops a run."""

import threading

import pytest

from kvscope.lab.capacity import FORMATS
from kvscope.lab.experiments import EXPERIMENTS, Cancelled, Control, run
from kvscope.lab.experiments.bench import Bench


@pytest.fixture(scope="module")
def bench():
    return Bench("demo")


def measure(bench, name):
    result = EXPERIMENTS[name].measure(bench, True)
    assert result.name == name and result.rows and result.verdict
    assert result.x in result.columns and set(result.ys) <= set(result.columns)
    assert all(len(row) == len(result.columns) for row in result.rows)
    return result


def test_naive_vs_cached_has_one_row_per_step(bench):
    # timings are not compared here (a shared machine's noise): benchmarks and the CLI do that
    r = measure(bench, "naive-vs-cached")
    assert r.column("context tokens") == list(range(32, 40))
    assert all(t > 0 for t in r.column("naive ms") + r.column("cached ms"))


def test_prompt_and_output_length_sweeps(bench):
    p = measure(bench, "prompt-length")
    assert p.column("prompt tokens") == [16, 32, 64]
    o = measure(bench, "output-length")
    assert o.column("output tokens") == [4, 8, 16]
    assert all(t > 0 for t in o.column("total ms") + p.column("TTFT ms"))


def test_warm_prefix_hits_whole_blocks_of_the_shared_part(bench):
    r = measure(bench, "warm-prefix")
    # 64-token prompts, 16-token blocks: the shared part rounded down to whole blocks
    assert r.column("cached fraction") == [0, 0.25, 0.5, 0.75, 0.75]
    assert r.column("ideal ms")[0] == r.column("TTFT ms")[0]


def test_warm_up_measures_each_request(bench):
    r = measure(bench, "warm-up")
    assert r.column("request") == [1, 2, 3, 4, 5, 6]
    assert all(t > 0 for t in r.column("total ms"))


def test_capacity_every_format_the_engines_bytes_are_the_formulas(bench):
    r = measure(bench, "capacity")
    assert r.column("format") == [label for label, _ in FORMATS]
    # the engine's tensors, measured, hold the bytes the formula says (scales included)
    assert r.column("engine bytes/token") == r.column("KV bytes/token")
    assert r.column("engine residual/request") == r.column("residual/request")
    by = {row[0]: dict(zip(r.columns, row, strict=True)) for row in r.rows}
    assert by["fp8"]["pool tokens"] == 2 * by["16-bit"]["pool tokens"]
    budget = 256 * by["16-bit"]["KV bytes/token"]
    for name, row in by.items():
        assert row["max running"] == row["formula requests"] > 0, name
        assert row["engine KV bytes"] <= budget, name  # KIVI's residuals out of the same budget
    assert by["kivi2"]["residual/request"] > 0 == by["int4_per_token_head"]["residual/request"]
    assert "the engine's tensors hold the formula's bytes in every format" in r.verdict


def test_fp8_halves_bytes_and_reports_agreement(bench):
    r = measure(bench, "fp8")
    assert "2048 (16-bit) -> 1024 (fp8)" in r.verdict
    assert all(0 < row[4] < 100 for row in r.rows)  # fp8 rounding moves the logits a little
    assert all(0 <= row[2] <= row[1] == 8 for row in r.rows)


def test_forced_logits_reproduce_the_engines_greedy_tokens(bench):
    # two prompts of different lengths and continuations batched: each row is its own
    from kvscope.engine import SamplingParams

    prompts = [bench.prompt(20, seed=5), bench.prompt(37, seed=6)]
    engine = bench.engine(kv_cache_dtype="bfloat16")
    outs = [engine.generate([p], SamplingParams(max_tokens=n, ignore_eos=True))[0]
            for p, n in zip(prompts, (6, 3), strict=True)]
    logits = bench.forced("bfloat16", prompts, [o.token_ids for o in outs]).logits
    assert [len(x) for x in logits] == [6, 3]
    for x, out in zip(logits, outs, strict=True):
        assert x.argmax(-1).tolist() == out.token_ids


def test_kv_formats_the_32_bit_row_is_exact_and_fewer_bits_diverge_more(bench):
    r = measure(bench, "kv-formats")
    rows = {row[0]: dict(zip(r.columns, row, strict=True)) for row in r.rows}
    assert list(rows) == ["float32", "bfloat16", "fp8", "fp8_per_head", "int8_per_token_head",
                          "int4_per_token_head", "kivi4", "kivi2"]
    ref = rows["float32"]
    for column in ("KLD mean", "KLD p99.9", "K-only KLD", "V-only KLD", "K err", "V err"):
        assert ref[column] == 0, column
    assert ref["top-1 %"] == 100 and ref["first divergence"] == "-"
    kld = {name: row["KLD mean"] for name, row in rows.items()}
    assert 0 < kld["bfloat16"] < kld["int8_per_token_head"] < kld["int4_per_token_head"]
    assert kld["kivi4"] < kld["kivi2"]
    for name, row in rows.items():
        if name != "float32":  # each side alone costs something
            assert row["K-only KLD"] > 0 and row["V-only KLD"] > 0
            assert row["K err"] > 0 and row["V err"] > 0
            assert row["KLD mean"] <= row["KLD p99.9"]
    assert [rows[n]["bytes/token"] for n in ("float32", "bfloat16", "fp8")] == [4096, 2048, 1024]
    assert rows["fp8"]["capacity x"] == 2 and rows["fp8"]["tokens/GiB"] == 2**30 // 1024
    assert rows["kivi2"]["bytes/token"] < rows["int4_per_token_head"]["bytes/token"]
    assert "int8_per_token_head: KLD" in r.verdict and "float32, the check: KLD 0," in r.verdict


def test_one_side_quantized_leaves_the_other_exactly_as_full_precision(bench):
    from kvscope.lab.experiments.kv_sides import layer_errors

    prompts = [bench.prompt(40, seed=1), bench.prompt(21, seed=2)]
    tokens = [[5, 6, 7], [8, 9]]
    ref = bench.forced("float32", prompts, tokens)
    lengths = [42, 22]
    for sides, exact in (("k", 1), ("v", 0)):
        run = bench.forced("int4_per_token_head", prompts, tokens, sides)
        errors = layer_errors(run, ref, lengths)
        # layer 0's input is the reference's, so its kept side is exact; later layers' inputs
        # carry the quantized side's error, which stays the larger
        assert errors[0][exact] == 0, (sides, errors)
        assert all(e[1 - exact] > 0.01 and e[exact] < e[1 - exact] for e in errors)
    both = layer_errors(bench.forced("int4_per_token_head", prompts, tokens), ref, lengths)
    assert all(k > 0.01 and v > 0.01 for k, v in both)


def test_block_size_hits_are_whole_blocks(bench):
    r = measure(bench, "block-size")
    assert r.column("hit tokens") == r.column("whole-block hit tokens")
    assert r.column("hit tokens")[-1] == 0  # 40 shared tokens: less than one 64-token block


def test_offload_hits_the_host_for_the_whole_prefix_and_recomputes_it_cold(bench):
    r = measure(bench, "offload")
    lengths = r.column("prefix tokens")
    assert lengths == [32, 64, 128]  # whole 16-token blocks, an 8-token suffix after them
    assert r.column("recompute hit tokens") == [0, 0, 0]
    assert r.column("device hit tokens") == lengths
    assert r.column("host hit tokens") == lengths  # metrics.host_cached_tokens: every block
    assert all(t > 0 for t in r.column("load ms"))  # the step records' transfer_s


def test_progress_reaches_the_end_and_cancel_stops_a_run():
    seen = []
    r = run("fp8", control=Control(progress=lambda f, _text: seen.append(f)), quick=True)
    assert r.model == "demo"
    assert seen[-1] == 1.0 and seen == sorted(seen)
    stop = threading.Event()

    def cancel_at_half(f, _text):
        if f >= 0.5:
            stop.set()

    with pytest.raises(Cancelled):
        run("fp8", control=Control(cancel_at_half, stop.is_set), quick=True)


def test_an_unknown_experiment_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown experiment 'naive'; one of: naive-vs-cached"):
        run("naive")
