"""A recorded session as the cache lab's input: the recorder keeps each prompt's block chain
(keyed like the pool's hashes), and the lab's replay of the session finds the hits the engine
found; a file from before the chains were recorded is refused in one line."""

from __future__ import annotations

import sqlite3

import pytest

from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.lab import whatif
from kvscope.lab.traces import TraceError
from kvscope.sessions import Recorder, SessionReader
from kvscope.sessions.lab_input import load_lab_input

SHARED = "Shared notes on lists and tuples. " * 12
PROMPTS = [SHARED + "First?", "Something else entirely, about sets. " * 5, SHARED + "Again?",
           SHARED + "First?"]


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """A real demo-model session, one request after another; the engine's own cache hits."""
    from kvscope.engine import Engine

    path = tmp_path_factory.mktemp("labin") / "s.kvscope"
    engine = Engine.from_pretrained("demo", EngineConfig(num_blocks=128, block_size=16))
    cached = {}
    with Recorder(path, engine):
        for prompt in PROMPTS:
            rid = engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        cached[out.request_id] = out.num_cached_tokens
            assert rid in cached
    return path, cached


def test_the_lab_replays_a_session_with_the_engines_hits(session):
    path, cached = session
    trace = load_lab_input(path)
    assert trace.format == "session" and len(trace.requests) == len(PROMPTS)
    assert sum(cached.values()) > 0
    r = whatif.replay(trace, 128, 16, "lru")
    assert r.hit_tokens == sum(cached.values())
    assert r.num_requests_hit == sum(1 for n in cached.values() if n)


def test_chains_are_stored_keyed_like_the_pools_hashes(session):
    with SessionReader(session[0]) as reader:
        chains = reader.request_chains()
        stored = {h for e in reader.events_between(reader.first_step, reader.last_step)
                  if e.kind == "cached" for h in e.block_hashes}
        requests = reader.requests()
    for r in requests:
        assert len(chains[r.request_id]) == r.prompt_tokens // 16
        assert set(chains[r.request_id].tolist()) <= stored  # every prompt block was cached


def test_a_session_recorded_without_chains_is_refused_in_one_line(session, tmp_path, capsys):
    from kvscope.app.cli import main as cli

    old = tmp_path / "old.kvscope"
    old.write_bytes(session[0].read_bytes())
    with sqlite3.connect(old) as conn:
        conn.execute("DROP TABLE request_chains")
    conn.close()
    with pytest.raises(TraceError, match="recorded before kvscope kept each request's"):
        load_lab_input(old)
    assert cli.main(["lab", str(old), "--format", "session"]) == 2
    err = capsys.readouterr().err
    assert "cannot replay it" in err and len(err.strip().splitlines()) == 1
    assert cli.main(["lab", str(session[0]), "--pool-blocks", "128"]) == 0


def test_the_lab_replays_a_hybrid_session_with_its_groups(tmp_path, hybrid_model_dir, capsys):
    """A real hybrid model (full attention + a 6-token window: two KV-cache groups), requests one
    after another with shared prefixes: the lab replays the session with the session's groups
    and finds the engine's hits (a pool too large to evict: everything stays cached)."""
    from session_testutil import make_engine, prompt

    from kvscope.app.cli import main as cli

    engine = make_engine(hybrid_model_dir, num_blocks=96)
    base = prompt(22, 1)
    prompts = [base, base[:16] + prompt(7, 2), prompt(10, 3), base + prompt(5, 4)]
    path, cached = tmp_path / "hybrid.kvscope", {}
    with Recorder(path, engine):
        for p in prompts:
            engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True))
            while engine.has_unfinished():
                cached.update((o.request_id, o.num_cached_tokens) for o in engine.step()
                              if o.finished)
    with SessionReader(path) as reader:
        groups = reader.groups
    assert [g.window for g in groups] == [None, 6]
    trace = load_lab_input(path)
    assert trace.groups == groups
    r = whatif.replay(trace, 96, 4, "lru")
    assert r.groups == groups and r.evicted_blocks == 0
    assert r.hit_tokens == sum(cached.values()) > 0
    assert cli.main(["lab", str(path), "--block-size", "4", "--pool-blocks", "96"]) == 0
    assert "KV-cache groups: full attention + sliding window 6 (full,window:6)" in \
        capsys.readouterr().out
    assert cli.main(["lab", str(path), "--block-size", "4", "--pool-blocks", "96",
                     "--groups", "full"]) == 0  # a what-if: the same session, one group
    assert "KV-cache groups: full attention (full)" in capsys.readouterr().out
