"""Block hashes in a session cannot confirm a guessed prompt: stored keyed per file (structure
kept), raw only on request."""

from __future__ import annotations

import numpy as np
import pytest
from rec_util import drive, make_engine, rec_model_dir  # noqa: F401 - a fixture

from kvscope.app.cli import main as cli
from kvscope.engine import events as ev
from kvscope.engine.stream import StepQueue
from kvscope.sessions import Recorder, SessionReader


def run(path, model_dir, **kw):
    """Record the seeded workload; return the live short hashes it produced and the recorder."""
    engine = make_engine(model_dir)
    live = set()
    tap = StepQueue()
    engine.subscribe(tap)
    with Recorder(path, engine, keyframe_every=10, keyframe_budget=1.0, **kw) as rec:
        drive(engine, max_steps=60, on_step=lambda e: live.update(
            e.snapshot().block_hash.tolist() + e.snapshot().parent_hash.tolist()))
    for u in tap.drain():
        for e in u.events:
            live.update(e.hashes)
    live.discard(0)
    return live, rec


def stored(path) -> tuple[set[int], list[np.ndarray]]:
    """Every hash value in the file (events and keyframes), and the keyframes' hash arrays."""
    with SessionReader(path) as s:
        values = {h for e in s.events_between(s.first_step, s.last_step)
                  if e.kind == ev.CACHED for h in e.hashes}
        arrays = []
        for k in s.keyframe_steps:
            snap = s.snapshot_at(k)
            arrays.append(np.concatenate([snap.block_hash, snap.parent_hash]))
            values.update(arrays[-1].tolist())
    values.discard(0)
    return values, arrays


@pytest.fixture(scope="module")
def sessions(tmp_path_factory, rec_model_dir):  # noqa: F811
    d = tmp_path_factory.mktemp("privacy")
    live, _ = run(d / "raw.kvscope", rec_model_dir, raw_hashes=True)
    live_a, rec_a = run(d / "a.kvscope", rec_model_dir)
    live_b, _ = run(d / "b.kvscope", rec_model_dir)
    assert live == live_a == live_b and len(live) > 20  # the same run three times
    return d, live, rec_a


def test_keyed_files_hold_no_engine_hash_and_differ_per_file(sessions):
    d, live, rec = sessions
    raw, _ = stored(d / "raw.kvscope")
    a, _ = stored(d / "a.kvscope")
    b, _ = stored(d / "b.kvscope")
    assert raw <= live and len(raw) > 20
    assert not a & live and not b & live  # nothing to match a guessed prompt's hashes against
    assert not a & b  # nor one file against another
    assert len(a) == len(b) == len(raw)
    key = rec._hash_key
    assert key not in (d / "a.kvscope").read_bytes()
    with SessionReader(d / "a.kvscope") as s, SessionReader(d / "raw.kvscope") as r:
        assert (s.block_hashes, r.block_hashes) == ("keyed", "raw")


def test_keyed_hashes_keep_the_structure_within_the_file(sessions):
    d, _, _ = sessions
    _, raw = stored(d / "raw.kvscope")
    _, keyed = stored(d / "a.kvscope")
    mapping = {}
    for r, k in zip(raw, keyed, strict=True):  # one consistent one-to-one renaming
        for x, y in zip(r.tolist(), k.tolist(), strict=True):
            assert (x == 0) == (y == 0)
            assert mapping.setdefault(x, y) == y
    assert len(set(mapping.values())) == len(mapping)


def test_the_cli_option_and_its_guard(tmp_path, capsys):
    assert cli.main(["run", "--workload", "two_tenants", "--record-raw-hashes"]) == 2
    assert "--record-raw-hashes needs --record" in capsys.readouterr().err
