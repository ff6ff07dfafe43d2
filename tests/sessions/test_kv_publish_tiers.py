"""Tiers in the published stream: the device tier as "GPU", the host tier as "CPU" (offloads are
CPU stores, host evictions CPU removals, loads back GPU stores), decoded by the attach mirror into
the engine's own per-tier resident sets."""

from __future__ import annotations

import random
import time
from collections import Counter

from kvscope.engine import events as ev
from kvscope.engine.block_hash import short_hash
from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.kv_cache_manager import KVCacheManager
from kvscope.sessions.kv_events import Attachment, KVEventPublisher, Mirror
from kvscope.sessions.kv_events.publisher import TierHashes, to_kv_events
from kvscope.sessions.kv_events.wire import Batch, Cleared, Removed, Stored


def hashes_of(pool) -> Counter:
    """short hash -> blocks of a BlockPool holding it (its copies counted)."""
    return Counter({short_hash(h): 1 + len(pool.copies.get(h, ())) for h in pool.hash_to_block})


class Published:
    """A manager with a host tier, its events published as they happen, named for reading."""

    def __init__(self, num_blocks: int, host_blocks: int):
        self.m = KVCacheManager(num_blocks, 4, host_blocks=host_blocks)
        self.tiers = TierHashes(host=True)
        self.names: dict[int, str] = {}

    def run(self, action, *args, chain: str | None = None) -> list:
        action(*args)
        events = self.m.events.drain()
        if chain:  # name the blocks this action cached: chain + index
            (hashes,) = [e.block_hashes for e in events if e.kind == ev.CACHED]
            self.names.update({h: f"{chain}{i}" for i, h in enumerate(hashes)})
        return to_kv_events(events, self.tiers, 4)

    def read(self, out: list) -> list[tuple]:
        name = self.names.get
        return [(type(e).__name__, e.medium, [name(h) for h in e.hashes]) +
                ((name(e.parent),) if isinstance(e, Stored) else ()) for e in out]


def test_offload_host_eviction_and_load_back_as_vllm_tier_events():
    p = Published(num_blocks=4, host_blocks=3)
    a, b = list(range(100, 112)), list(range(200, 216))  # 3 and 4 full blocks
    assert p.read(p.run(p.m.admit, 1, a, chain="a")) == [("Stored", "GPU", ["a0", "a1", "a2"],
                                                          None)]
    assert p.run(p.m.free, 1) == []
    # b takes the whole pool: a's cached blocks are evicted tail first and copied to the host,
    # published as one CPU chain, head first (a copy: the device's removal says it left there)
    assert p.read(p.run(p.m.admit, 2, b, chain="b")) == [
        ("Removed", "GPU", ["a2", "a1", "a0"]),
        ("Stored", "CPU", ["a0", "a1", "a2"], None),
        ("Stored", "GPU", ["b0", "b1", "b2", "b3"], None)]
    p.run(p.m.free, 2)
    # a again: a0, a1 are loaded back from the host (GPU stores; the host keeps its copies), a2
    # is recomputed. Held for the load, a0 and a1 leave one host block: of b3 and b2 (evicted
    # tail first) the host takes the last evicted, b2, into a2's place (a host eviction), b3 is
    # dropped; then b1 takes b2's place. Each CPU store names its parent, still on the device.
    # The offloads the load's own allocation causes come after its GPU store (HostTier).
    assert p.read(p.run(p.m.admit, 3, a)) == [
        ("Removed", "GPU", ["b3", "b2"]),
        ("Stored", "GPU", ["a0", "a1"], None),
        ("Removed", "CPU", ["a2"]),
        ("Stored", "CPU", ["b2"], "b1"),
        ("Removed", "GPU", ["b1"]),
        ("Removed", "CPU", ["b2"]),
        ("Stored", "CPU", ["b1"], "b0"),
        ("Stored", "GPU", ["a2"], "a1")]
    host = p.m.counters()
    assert (host.num_offloaded_blocks, host.num_loaded_blocks, host.num_host_evicted_blocks) == \
        (5, 2, 2)
    # what the publisher holds is what the two pools hold
    assert Counter(h for _, h in p.tiers.device.by_block.values()) == hashes_of(p.m.pool)
    assert Counter(h for _, h in p.tiers.host.by_block.values()) == hashes_of(p.m.host.pool)


def test_a_reset_with_a_host_tier_removes_the_device_tier_only():
    p = Published(num_blocks=4, host_blocks=4)
    p.run(p.m.admit, 1, list(range(100, 112)), chain="a")
    p.run(p.m.free, 1)
    p.run(p.m.admit, 2, list(range(200, 216)), chain="b")  # a goes to the host
    out = p.run(p.m.reset_prefix_cache)
    # not AllBlocksCleared: the host keeps a0..a2, and consumers drop every tier on it
    assert sorted(p.read(out)) == [("Removed", "GPU", ["b0", "b1", "b2", "b3"])]
    assert not p.tiers.device.by_block and len(p.tiers.host.by_block) == 3
    one_tier = TierHashes()
    assert to_kv_events([ev.Event(ev.RESET, 0, None, ())], one_tier, 4) == [Cleared()]


def test_a_failed_steps_registrations_are_removed():
    tiers = TierHashes()
    stored = ev.Event(ev.CACHED, 0, 1, (5, 6), 0, (11, 12, 99, 11))
    failed = ev.Event(ev.UNCACHED, 0, 1, (6,))
    out = to_kv_events([stored, failed], tiers, 4)
    assert out[1:] == [Removed([12], "GPU", 0)] and tiers.device.by_block == {5: (0, 11)}


def test_a_parent_held_by_the_host_only_is_named():
    tiers = TierHashes(host=True)
    offload = ev.Event(ev.OFFLOADED, 0, 1, (7, 0), 0, (11, 99))  # device 7 -> host 0
    evict = ev.Event(ev.EVICTED, 0, 1, (7,))
    recompute = ev.Event(ev.CACHED, 1, 2, (7,), 0, (12, 11))  # 11's child, on the device
    out = to_kv_events([evict, offload, recompute], tiers, 4)
    assert [(type(e).__name__, e.medium, e.hashes, getattr(e, "parent", None)) for e in out] \
        == [("Stored", "CPU", [11], None), ("Stored", "GPU", [12], 11)]


# ------------------------------------------------------------------------- end to end
def mirror_tier(mirror: Mirror, medium: str) -> Counter:
    return Counter({k[3]: refs for k, (refs, *_) in mirror.blocks.items() if k[2] == medium})


def test_the_mirror_of_a_two_tier_engine_holds_its_per_tier_resident_sets(tiny_model_dir):
    """An engine with a host tier publishes; kvscope attaches on loopback. Traffic over a few
    prefixes on a pool too small for them evicts to the host, hits from the host and evicts on
    the host; at sampled steps and at the end the mirror's GPU hashes are the device pool's
    (copies counted) and its CPU hashes the host pool's."""
    from kvscope.engine import Engine

    engine = Engine.from_pretrained(str(tiny_model_dir), EngineConfig(
        block_size=4, num_blocks=24, host_blocks=12, max_num_seqs=4,
        max_num_batched_tokens=64))
    pub = KVEventPublisher(engine, "tcp://127.0.0.1:*", replay="tcp://127.0.0.1:*")
    att = Attachment(pub.endpoint, pub.replay_endpoint, replay_timeout_s=5.0).start()

    def caught_up() -> Mirror:
        deadline = time.monotonic() + 10
        while att.last < pub.seq - 1 and time.monotonic() < deadline:
            att.poll(10)
        assert att.last == pub.seq - 1
        return att.mirror

    def assert_tiers(m: Mirror) -> None:
        assert mirror_tier(m, "GPU") == hashes_of(engine.manager.pool)
        assert mirror_tier(m, "CPU") == hashes_of(engine.manager.host.pool)

    try:
        rng = random.Random(5)
        prefixes = [[rng.randrange(3, 300) for _ in range(n)] for n in (16, 24, 12, 20, 28)]
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        samples = 0
        for i in range(36):
            engine.add_request(rng.choice(prefixes) + [rng.randrange(3, 300)
                                                       for _ in range(rng.randrange(1, 6))],
                               params)
            if i % 2:
                engine.step()
            if i % 9 == 8:
                while engine.has_unfinished():
                    engine.step()
                assert_tiers(caught_up())
                samples += 1
        while engine.has_unfinished():
            engine.step()
        m = caught_up()
        assert_tiers(m)
        host = engine.counters()
        assert host.num_offloaded_blocks > 20 and host.num_loaded_blocks > 5
        assert host.num_host_evicted_blocks > 5 and samples == 4
        # a hash offloaded and loaded back is resident in both tiers at once
        both = [h for h in mirror_tier(m, "CPU") if m.residency(0, h) == {"GPU", "CPU"}]
        assert both and set(both) == set(mirror_tier(m, "CPU")) & set(mirror_tier(m, "GPU"))
        h = m.health
        assert (h.orphans, h.unknown_removes, h.duplicate_stores, h.lost) == (0, 0, 0, 0)
    finally:
        att.close()
        pub.close()


# ------------------------------------------------------------------------- vLLM's two forms
def test_vllms_two_forms_of_tier_stores_are_mirrored_per_tier():
    """vLLM's offloading connector publishes a tier as placeholders (no tokens, block_size 0, no
    parent: the default) or self-describing (`self_describing_kv_events`). Both are held by hash
    in their tier; a removal of an unknown hash is an orphan where every removal names the hashes
    its store named: the GPU tier, a tier of one form, and no longer after AllBlocksCleared."""
    from kv_fake_publisher import batch, cleared, removed, stored

    from kvscope.sessions.kv_events import decode_batch
    from kvscope.sessions.kv_events.slots import HashSlots, tier_lines

    m = Mirror()
    slots = HashSlots(m, num_slots=16)
    placeholder = dict(block_size=0, tokens=[], medium="CPU", group=0)
    full = dict(group=0, kind="full_attention")
    for events in ([stored([1, 2, 3], None, **full)],
                   [stored([1], None, **placeholder), stored([2], None, **placeholder)],
                   [stored([3], 2, medium="STORAGE", **full)],
                   [removed([9], medium="CPU"), removed([9], medium="STORAGE"),
                    removed([2], medium="CPU")]):
        m.apply(decode_batch(batch(events)))
    assert m.residency(0, 1) == {"GPU", "CPU"} and m.residency(0, 3) == {"GPU", "STORAGE"}
    assert m.residency(0, 2) == {"GPU"} and m.residency(0, 7) == set()
    assert m.tree(medium="CPU") == {1: None}  # a placeholder names no parent
    assert m.tree(medium="STORAGE") == {3: 2} and m.health.orphans == 0
    h = m.health
    assert h.unknown_removes == 2 and h.unknown_removes_by_medium == {"CPU": 1, "STORAGE": 1}
    assert h.orphan_removes == 2  # each tier's stores came in one form so far
    assert "(CPU 1, STORAGE 1; orphans, a store missed: 2)" in h.lines()[2]
    # the slot view: the block size comes from a store that names one, never a placeholder's 0
    slots.tick(0.0, 0.1)
    assert slots.config.block_size == 4
    assert tier_lines(slots.snapshot()) == [
        "tier GPU: 3 resident blocks",
        "tier CPU: 1 resident blocks · placeholder stores (no tokens, block_size 0)",
        "tier STORAGE: 1 resident blocks · self-describing stores"]
    on_gpu = slots.slot_of[(0, 0, "GPU", 1)]
    assert "· only in CPU" not in slots.describe(slots.slot_of[(0, 0, "CPU", 1)], "CPU")
    assert f"also in GPU (slot {on_gpu})" in slots.describe(slots.slot_of[(0, 0, "CPU", 1)],
                                                            "CPU")
    # CPU now mixes the forms: a removal there may fan out to hashes a placeholder never named
    m.apply(decode_batch(batch([stored([7, 8], None, medium="CPU", **full),
                                removed([5, 8], medium="CPU")])))
    assert (h.unknown_removes, h.orphan_removes) == (3, 2)
    # after an AllBlocksCleared the tiers behind the GPU may hold blocks the mirror dropped
    m.apply(decode_batch(batch([cleared(), removed([3], medium="STORAGE"),
                                removed([3], medium="GPU")])))
    assert (h.unknown_removes, h.orphan_removes) == (5, 3)  # only the GPU's counts


def test_a_placeholder_neither_sizes_the_slots_nor_fails_hash_parity():
    from kv_fake_publisher import batch, stored

    from kvscope.sessions.kv_events import decode_batch
    from kvscope.sessions.kv_events.parity import HashParity, HashSettings
    from kvscope.sessions.kv_events.slots import HashSlots

    parity = HashParity(HashSettings())
    parity.check(Stored([5], None, [], 0, "CPU"))
    assert parity.mismatched == 0 and sum(parity.unverifiable.values()) == 1

    m = Mirror()
    slots = HashSlots(m, num_slots=8, block_size=16)
    m.apply(decode_batch(batch([stored([5], None, block_size=0, tokens=[], medium="CPU")])))
    assert not slots.learn_block_size() and slots.config.block_size == 16
    m.apply(Batch(0.0, [Stored([6], None, [], 8)]))
    assert slots.learn_block_size() and slots.config.block_size == 8
