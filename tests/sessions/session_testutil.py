"""Helpers for tests/sessions (and the kill-test subprocess): a workload that exercises every
block event, and a digest of a Snapshot. A uniquely named module, not conftest."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import random

import numpy as np

from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.snapshot import Snapshot

BS = 4
POISON = 2  # prompts are drawn from 3..319: a forward pass computing token 2 raises (see drive)


def make_engine(model_dir, **kw):
    from kvscope.engine.engine import Engine  # torch: only where an engine runs
    from kvscope.engine.models.load import load_model

    cfg = dict(block_size=BS, num_blocks=40, max_num_batched_tokens=48, max_num_seqs=8)
    cfg.update(kw)
    return Engine(load_model(model_dir), EngineConfig(**cfg))


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


def drive(engine, on_step=None, max_steps: int = 160, seed: int = 0,
          forever: bool = False) -> int:
    """A seeded workload on a small pool that produces every block event: shared prefixes
    (hits), parallel sampling (fork + copy on write), salts, pressure (evictions, preemptions),
    cancels and prefix-cache resets between steps, rejected requests, and requests whose forward
    pass fails (their registered blocks are withdrawn). Calls on_step(engine) after every step.
    Returns the number of steps run."""
    rng = random.Random(seed)
    real_run = engine.runner.run

    def run(chunks, copies=()):
        if any(POISON in c.token_ids for c in chunks):
            raise RuntimeError("simulated kernel failure")
        return real_run(chunks, copies)

    engine.runner.run = run
    prefixes = [prompt(17, seed=1), prompt(9, seed=2)]

    def add(n_extra, **params):
        pre = rng.choice(prefixes) if rng.random() < 0.6 else []
        salt = rng.choice([None, None, "tenant-a", "tenant-b"])
        params.setdefault("max_tokens", rng.randrange(2, 24))
        engine.add_request(pre + prompt(n_extra, rng.randrange(10**6)),
                           SamplingParams(ignore_eos=True, **params), cache_salt=salt)

    add(6, max_tokens=12)
    add(9, max_tokens=10, n=2, temperature=1.0, seed=7)
    add(30, max_tokens=14)
    add(500, max_tokens=4)  # rejected: needs more than the pool
    steps = 0
    while steps < max_steps or forever:
        if rng.random() < 0.3 and (steps < max_steps - 20 or forever):
            if rng.random() < 0.15:
                add(rng.randrange(5, 30), n=rng.randrange(2, 4), temperature=0.9,
                    seed=rng.randrange(100))
            else:
                add(rng.randrange(3, 45))
        if rng.random() < 0.04:
            live = [r for r, q in engine.requests.items() if not q.finished]
            if live:
                engine.cancel(rng.choice(live))
        if steps in (30, 100):  # fails in the step that registers its blocks
            engine.add_request(prefixes[0] + prompt(12, steps) + [POISON],
                               SamplingParams(max_tokens=3))
        if steps in (40, 90) or (forever and steps % 50 == 49):
            engine.reset_prefix_cache()
        if not engine.has_unfinished():
            if steps >= max_steps and not forever:
                break
            add(rng.randrange(3, 45))
        engine.step()
        steps += 1
        if on_step is not None:
            on_step(engine)
    return steps


def snapshot_digest(s: Snapshot) -> str:
    h = hashlib.sha256()
    for name in ("state", "ref_count", "owner", "block_hash", "last_use", "lru_rank"):
        a = getattr(s, name)
        h.update(f"{name}:{a.dtype.str}:".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    for r in sorted(s.block_tables):
        h.update(f"t{r}:".encode() + np.asarray(s.block_tables[r], np.int32).tobytes())
    h.update(repr(sorted(s.num_computed_tokens.items())).encode())
    h.update(repr([s.step, s.block_size, s.num_free_blocks, s.num_active_blocks,
                   s.num_cached_blocks, s.num_shared_blocks, s.hit_tokens, s.query_tokens,
                   s.num_requests_queried, s.num_requests_hit, s.num_evicted_blocks,
                   s.num_cow_copies]).encode())
    return h.hexdigest()


def stored(snap: Snapshot, rec) -> Snapshot:
    """A live snapshot as recorder `rec` stores it: block hashes through rec.stored_hash."""
    out = copy.copy(snap)
    for name in ("block_hash", "parent_hash"):
        a = getattr(snap, name)
        setattr(out, name, np.array([rec.stored_hash(int(h)) for h in a], dtype=np.uint64))
    if snap.host is not None:  # the host tier's pool too
        out.host = stored(snap.host, rec)
    return out


def stored_event(e, rec):
    """A live event as recorder `rec` stores it."""
    return dataclasses.replace(e, hashes=tuple(rec.stored_hash(h) for h in e.hashes))
