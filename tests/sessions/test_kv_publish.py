"""End to end: our engine publishes vLLM KV events, kvscope attaches on loopback, and the mirror's
tree equals the engine's own (its snapshot) at sampled steps and at the end; no event lost."""

import random
import time

from kvscope.engine import events as ev
from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.sessions.kv_events import Attachment, KVEventPublisher


def engine_tree(snap) -> dict:
    return {int(h): int(p) for h, p, in zip(snap.block_hash, snap.parent_hash, strict=True) if h}


def linked(tree: dict) -> dict:
    """The edges among resident blocks: a parent that is not resident reads as None."""
    return {h: (p if p in tree else None) for h, p in tree.items()}


def catch_up(att, pub, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while att.last < pub.seq - 1 and time.monotonic() < deadline:
        att.poll(10)
    assert att.last == pub.seq - 1


def assert_mirrors(att, engine):
    # the device tier is published as "GPU", on a CPU build too
    mirror, snap = att.mirror.tree(medium="GPU"), engine_tree(engine.snapshot())
    assert set(mirror) == set(snap) and linked(mirror) == linked(snap)
    # a parent the mirror names is the engine's parent (never invented)
    assert all(p is None or p == snap[h] for h, p in mirror.items())


def test_mirror_of_our_engine_equals_its_snapshot():
    from kvscope.engine import Engine

    engine = Engine.from_pretrained("demo", EngineConfig(block_size=4, num_blocks=40,
                                                         max_num_seqs=12,
                                                         max_num_batched_tokens=256))
    pub = KVEventPublisher(engine, "tcp://127.0.0.1:*", replay="tcp://127.0.0.1:*",
                           topic="kv")
    cached = []  # the engine's own count of cached blocks, from its step stream
    engine.subscribe(
        lambda u: cached.extend(b for e in u.events if e.kind == ev.CACHED for b in e.blocks))
    engine.generate([list(range(3, 40))], SamplingParams(max_tokens=4, ignore_eos=True))
    att = Attachment(pub.endpoint, pub.replay_endpoint, topic="kv", replay_timeout_s=5.0)
    try:
        att.start()  # what was published before attaching comes from the replay endpoint
        assert att.health.first_seq == {pub.endpoint: 0} and att.health.replayed == pub.seq > 0
        rng = random.Random(0)
        prefixes = [[rng.randrange(3, 300) for _ in range(n)] for n in (12, 20, 8)]
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        submitted, steps, samples = 0, 0, 0
        while submitted < 200 or engine.has_unfinished():
            for _ in range(3 if submitted < 200 else 0):
                prompt = rng.choice(prefixes) + [rng.randrange(3, 300)
                                                 for _ in range(rng.randrange(1, 14))]
                engine.add_request(prompt, params,
                                   cache_salt=rng.choice([None, None, None, "tenant"]))
                submitted += 1
            if steps == 40:
                engine.reset_prefix_cache()  # AllBlocksCleared on the wire
            engine.step()
            steps += 1
            att.poll(0)
            if steps % 10 == 0:
                catch_up(att, pub)
                assert_mirrors(att, engine)
                samples += 1
        catch_up(att, pub)
        assert_mirrors(att, engine)
        assert samples >= 5
        snap, mirror, h = engine.snapshot(), att.mirror, att.health
        assert mirror.num_stored == len(cached) and mirror.num_removed == snap.num_evicted_blocks
        assert snap.num_evicted_blocks > 50  # the small pool really evicted
        # a gap can only come from the first live messages racing the subscription
        assert h.repaired == h.gaps <= 1 and h.restarts == 0
        assert (h.lost, h.orphans, h.bad_messages, h.duplicate_stores) == (0, 0, 0, 0)
        assert mirror.num_cleared > 0 and pub.seq > 50
    finally:
        att.close()
        pub.close()
