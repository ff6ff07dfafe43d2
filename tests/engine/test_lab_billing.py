"""Prompt caching as an API bills it (kvscope.lab.billing): costs computed by hand, the ttl
policy's replay against a plain simulation on the Mooncake conversation trace, and the miss
explained as expired."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvscope.engine.config import EngineConfig
from kvscope.engine.kv_cache_manager import KVCacheManager
from kvscope.lab import billing
from kvscope.lab.traces import LabRequest, Trace, load_trace
from tests.engine.plain_ttl import plain_ttl

TRACE = Path(__file__).parents[1] / "data" / "mooncake_conversation_head800.jsonl"
# $1 a token: a cost reads as tokens times their multiplier
UNIT = billing.Prices(input=1e6, write=1.25, read=0.1, min_tokens=0, output=0.0)


def trace(*requests: tuple[float, int], breakpoint: int | None = None) -> Trace:
    """Requests (arrival s, prompt tokens) of one shared prompt (trace blocks of 512)."""
    return Trace("t", "mooncake", 512, [LabRequest(t, n, 4, (0, 1, 2, 3)[: -(-n // 512)],
                                                   breakpoint) for t, n in requests], 0)


def test_one_write_and_one_read_cost_1_35_c_against_2_c():
    # 513 tokens: 512 cacheable (full blocks before the last token), 1 always computed
    bill = billing.run(trace((0, 513), (60, 513)), 300, UNIT)
    assert (bill.written_tokens, bill.read_tokens, bill.uncached_tokens) == (512, 512, 2)
    assert bill.cost == pytest.approx(1.35 * 512 + 2)
    assert bill.cost_without_cache == pytest.approx(2 * 513)
    assert bill.request_hit_ratio == 0.5 and bill.token_hit_ratio == pytest.approx(512 / 1026)
    (prefix,) = bill.prefixes
    assert (prefix.start_token, prefix.end_token, prefix.writes, prefix.hits) == (0, 512, 1, 1)
    assert prefix.paid(UNIT) and prefix.saving(UNIT) == pytest.approx(512 * (0.9 - 0.25))


def test_a_prefix_that_expires_between_uses_pays_two_writes():
    bill = billing.run(trace((0, 513), (301, 513)), 300, UNIT)
    assert (bill.written_tokens, bill.read_tokens) == (1024, 0)
    assert bill.cost == pytest.approx(2 * 1.25 * 512 + 2)
    assert bill.expired_blocks == 32
    (prefix,) = bill.prefixes
    assert (prefix.writes, prefix.hits) == (2, 0) and not prefix.paid(UNIT)
    # at exactly the TTL it is still there
    assert billing.run(trace((0, 513), (300, 513)), 300, UNIT).read_tokens == 512


def test_a_prompt_below_the_minimum_is_never_written():
    prices = billing.Prices(1e6, 1.25, 0.1, min_tokens=1024, output=0.0)
    bill = billing.run(trace((0, 513), (1, 513), (2, 2000)), 300, prices)
    # the 2,000-token prompt caches its 1,984 tokens of full blocks; the short ones nothing
    assert (bill.written_tokens, bill.read_tokens) == (1984, 0)
    assert bill.cost == pytest.approx(2 * 513 + 1.25 * 1984 + 16)


def test_a_breakpoint_caches_only_up_to_it():
    bill = billing.run(trace((0, 2000), (10, 2000), breakpoint=1030), 300, UNIT)
    assert (bill.written_tokens, bill.read_tokens) == (1024, 1024)


def test_break_even_hits_per_write():
    assert UNIT.break_even == pytest.approx(0.25 / 0.9)  # one hit pays
    one_hour = billing.PRESETS["anthropic-1h"][0]
    assert one_hour.break_even == pytest.approx(1 / 0.9)  # one hit does not
    prefix = billing.Prefix(0, 512, writes=1, hits=1, first_request=0)
    assert prefix.paid(UNIT) and not prefix.paid(one_hour)
    assert billing.Prices(read=1.0).break_even == float("inf")


@pytest.mark.parametrize("mode", ["sequential", "timed"])
@pytest.mark.parametrize("ttl", [2, 10, 60])
def test_ttl_replay_matches_a_plain_simulation_exactly(mode, ttl):
    # the conversation trace's first 300 requests span about 100 s (timestamps in ms); timed:
    # a slow 0.5 s per output token, so that requests hold their blocks for minutes
    t = load_trace(TRACE, limit=300)
    bill = billing.run(t, ttl, billing.Prices(min_tokens=0), mode=mode, tpot_s=0.5)
    assert (bill.read_tokens, bill.written_tokens, bill.requests_read) == \
        plain_ttl(TRACE, ttl, 300, timed=mode == "timed", tpot_s=0.5)


def test_a_longer_ttl_reads_more():
    t = load_trace(TRACE, limit=150)
    reads = [billing.run(t, ttl, billing.Prices()).read_tokens for ttl in (2, 60)]
    assert reads[0] < reads[1]


def test_why_it_missed_under_a_ttl_says_expired():
    mgr = KVCacheManager(64, 16, eviction_policy="ttl", ttl_s=300)
    prompt = list(range(40))
    mgr.admit(1, prompt)
    mgr.free(1)
    mgr.begin_step(1)
    mgr.advance_clock(312)
    assert mgr.admit(2, prompt) == 0
    why = mgr.explain_miss(2)
    assert why.reason == "expired"
    assert "expired 312 s after its last use (TTL 300 s)" in why.message


def test_ttl_with_a_capacity_evicts_least_recently_released_first():
    mgr = KVCacheManager(4, 16, eviction_policy="ttl", ttl_s=1000)
    a, b = list(range(17)), list(range(100, 117))
    mgr.admit(1, a)
    mgr.free(1)
    mgr.advance_clock(1)
    mgr.admit(2, b)
    mgr.free(2)
    mgr.admit(3, list(range(200, 233)))  # needs 3 blocks: evicts a's full block first
    mgr.free(3)
    assert mgr.admit(4, b) == 16 and mgr.admit(5, a) == 0


def test_the_engine_refuses_the_ttl_policy():
    with pytest.raises(ValueError, match="needs a trace's clock"):
        EngineConfig(eviction_policy="ttl")


def test_the_experiment_rare_prefixes_do_not_pay_at_five_minutes():
    from kvscope.lab.experiments import EXPERIMENTS
    from kvscope.lab.experiments.bench import Bench

    result = EXPERIMENTS["prompt-cache-ttl"].measure(Bench("demo"), True)
    rows = [dict(zip(result.columns, row, strict=True)) for row in result.rows]
    for r in rows:  # every request writes its system prompt or reads it
        assert r["writes"] + r["hits"] == r["requests"]
        assert (r["paid"] == "yes") == (r["hits"] > r["writes"] * r["break-even"])
    by = {(r["prices"], r["mean gap s"]): r for r in rows}
    assert by["anthropic-5m", 3600]["paid"] == "no" and by["anthropic-1h", 20]["paid"] == "yes"
    assert by["anthropic-5m", 20]["writes"] == 1


def test_lab_command_bills_the_trace_per_ttl(tmp_path, capsys):
    from kvscope.app.cli import lab_billing
    from kvscope.app.cli import main as cli

    out = tmp_path / "bill.csv"
    assert cli.main(["lab", str(TRACE), "--limit", "150", "--ttl", "10", "60", "--prices",
                     "anthropic-1h", "--read-mult", "0.2", "--csv", str(out)]) == 0
    printed = capsys.readouterr().out
    prices = billing.Prices(3.0, 2.0, 0.2, 1024, 15.0)
    t = load_trace(TRACE, limit=150)
    for ttl in (10, 60):
        b = billing.run(t, ttl, prices)
        assert f"{b.cost:>10,.4f} {b.cost_without_cache:>10,.4f}" in printed
        assert billing.verdict(b) in printed
    assert "more than 1.25 hits per write" in printed and "2025" in printed
    rows = [line.split(",") for line in out.read_text().splitlines()]
    assert rows[0] == list(lab_billing.CSV_COLUMNS) and [r[0] for r in rows[1:]] == ["10.0",
                                                                                    "60.0"]
    prefixes = (tmp_path / "bill-prefixes.csv").read_text().splitlines()
    assert prefixes[0].startswith("ttl_s,pool_blocks,start_token,end_token,writes,hits")


@pytest.mark.parametrize("argv, message", [
    (["--ttl", "0"], "--ttl must be > 0 seconds"),
    (["--ttl", "300", "--write-mult", "-1"], "write price must be >= 0"),
    (["--ttl", "300", "--replicas", "2"], "--replicas with --ttl is not supported"),
    (["--ttl", "300", "--host-blocks", "100"], "--host-blocks with --ttl is not supported"),
])
def test_lab_billing_errors_are_one_line_with_exit_2(argv, message, capsys):
    from kvscope.app.cli import main as cli

    assert cli.main(["lab", str(TRACE), "--limit", "20", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_capacity_too_evicts_and_reads_less():
    t = load_trace(TRACE, limit=150)
    prices = billing.Prices(min_tokens=0)
    free, tight = (billing.run(t, 60, prices, pool_blocks=size) for size in (None, 10_000))
    assert free.evicted_blocks == 0 < tight.evicted_blocks
    assert tight.read_tokens < free.read_tokens
    assert tight.read_tokens + tight.written_tokens == free.read_tokens + free.written_tokens
