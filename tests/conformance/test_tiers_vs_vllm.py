"""The CPU tier as vLLM 0.33's offloading connector publishes it, by its own event translation
(`OffloadingEventsTracker`) in both of its forms, encoded as vLLM's publisher encodes a batch and
decoded by attach's mirror: placeholder stores (the default: one per offloaded chunk, naming its
last hash, no tokens, block_size 0) and self-describing stores (the chunk's hashes, parent and
tokens); a removal names what its store named, except where a tier mixes the two forms."""

from __future__ import annotations

import msgspec
import vllm_ref as vr

from kvscope.sessions.kv_events import Mirror, decode_batch

BLOCK, CHUNK = 4, 8  # two blocks per offloaded chunk


class Connector:
    """vLLM's tracker for one request of 16 tokens (4 blocks, 2 chunks) on KV group 0."""

    def __init__(self, self_describing: bool):
        spec = vr.OffloadingEventGroupSpec("full_attention", None)
        self.tracker = vr.OffloadingEventsTracker(
            vr.OffloadingKVEventsConfig(True, self_describing), {0: spec})
        self.group = vr.GroupOffloadConfig(0, BLOCK, CHUNK, CHUNK // BLOCK, spec, None, None, None)
        hasher = vr.get_request_block_hasher(BLOCK, vr.sha256)
        self.req = vr.Request("r", list(range(100, 116)), vr.SamplingParams(max_tokens=1), None,
                              block_hasher=hasher)
        raw = self.req.block_hashes
        self.h = [vr.maybe_convert_block_hash(b) for b in raw]  # as published
        self.keys = [vr.make_offload_key(raw[i], 0) for i in (1, 3)]  # a chunk's key: its last

    def gpu_store(self) -> list:
        """The request's blocks as vLLM's block pool publishes them."""
        return [vr.BlockStored(block_hashes=self.h, parent_block_hash=None,
                               token_ids=list(range(100, 116)), block_size=BLOCK, lora_id=None,
                               medium="GPU", lora_name=None, group_idx=0)]

    def offload(self, chunks: list[int], removed: bool = False) -> list:
        event = vr.OffloadingEvent([self.keys[c] for c in chunks], vr.Medium.CPU, removed)
        return list(self.tracker.take_events([event]))


def apply(m: Mirror, events: list) -> None:
    payload = msgspec.msgpack.Encoder().encode(vr.KVEventBatch(ts=1.0, events=events))
    m.apply(decode_batch(payload))


def test_placeholder_cpu_stores_hold_each_chunks_key():
    c, m = Connector(self_describing=False), Mirror()
    apply(m, c.gpu_store())
    stores = c.offload([0, 1])
    assert [(s.block_hashes, s.block_size, s.token_ids) for s in stores] == \
        [([c.h[1]], 0, []), ([c.h[3]], 0, [])]
    apply(m, stores)
    assert m.tree(medium="CPU") == {c.h[1]: None, c.h[3]: None}
    assert m.residency(0, c.h[3]) == {"GPU", "CPU"} and m.residency(0, c.h[2]) == {"GPU"}
    apply(m, c.offload([0], removed=True))
    assert set(m.tree(medium="CPU")) == {c.h[3]} and m.health.unknown_removes == 0
    assert m.forms[(0, "CPU")] == {"placeholder"}


def test_self_describing_cpu_stores_chain_each_chunks_blocks():
    c, m = Connector(self_describing=True), Mirror()
    apply(m, c.gpu_store())
    for chunk, key in enumerate(c.keys):
        c.tracker.record_store(c.req, c.group, chunk, key)
    apply(m, c.offload([0, 1]))
    assert m.tree(medium="CPU") == {c.h[0]: None, c.h[1]: c.h[0], c.h[2]: c.h[1],
                                    c.h[3]: c.h[2]}
    apply(m, c.offload([0], removed=True))  # fans out to the chunk's hashes
    assert set(m.tree(medium="CPU")) == {c.h[2], c.h[3]}
    h = m.health
    assert (h.orphans, h.unknown_removes) == (0, 0) and m.forms[(0, "CPU")] == {"self-describing"}


def test_a_tier_mixing_the_forms_removes_hashes_it_never_stored_without_orphans():
    """With self-describing events on, a chunk whose metadata the connector lacks (a promotion
    it did not see as a hit) is stored as a placeholder; once a lookup records the metadata, its
    removal fans out to the chunk's hashes, one of which no store named."""
    c, m = Connector(self_describing=True), Mirror()
    apply(m, c.offload([1]))  # no metadata: a placeholder of h3
    c.tracker.record_store(c.req, c.group, 0, c.keys[0])
    apply(m, c.offload([0]))  # self-describing: h0, h1
    c.tracker.record_lookup(c.req, c.group, 1, c.keys[1])
    removal = c.offload([1], removed=True)
    assert [r.block_hashes for r in removal] == [[c.h[2], c.h[3]]]
    apply(m, removal)
    h = m.health
    assert set(m.tree(medium="CPU")) == {c.h[0], c.h[1]}
    assert (h.unknown_removes, h.orphan_removes, h.orphans) == (1, 0, 0)
