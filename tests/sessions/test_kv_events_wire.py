"""Decoding vLLM / SGLang KV-event payloads, and the mirror they feed (no sockets here)."""

import msgspec
import pytest
from kv_fake_publisher import batch, cleared, removed, stored

from kvscope.sessions.kv_events import (
    Batch,
    Cleared,
    Mirror,
    Removed,
    Stored,
    WireError,
    decode_batch,
    encode_batch,
)

BIG = 2**64 - 5  # vLLM's uint64 hashes are often above 2**63


def test_map_and_array_encodings_decode_to_the_same_events():
    for layout in ("map", "array"):
        b = decode_batch(batch([stored([BIG, 7], None, group=1, layout=layout),
                                removed([BIG], medium="CPU", group=1, layout=layout),
                                cleared(layout)], rank=3, layout=layout))
        assert b.dp_rank == 3 and b.ts == 1000.0
        s, r, c = b.events
        assert (s.hashes, s.parent, s.block_size, s.medium, s.group) == ([BIG, 7], None, 4,
                                                                        "GPU", 1)
        assert s.token_ids == list(range(8))
        assert (r.hashes, r.medium, r.group) == ([BIG], "CPU", 1)
        assert isinstance(c, Cleared)


def test_unknown_fields_are_ignored_and_missing_ones_default():
    newer = stored([1], 9, extra={"locality": "LOCAL", "session_id": "s", "future": [1, 2]})
    v09 = ["BlockStored", [2], 1, [5, 6], 2, None]  # no medium, no group: GPU, group 0
    sglang_removed = ["BlockRemoved", [2]]
    b = decode_batch(msgspec.msgpack.encode({"ts": 1, "events": [newer, v09, sglang_removed],
                                             "data_parallel_rank": None, "extra": 1}))
    assert [(e.hashes, e.medium, e.group) for e in b.events] == [([1], "GPU", 0),
                                                                 ([2], "GPU", 0),
                                                                 ([2], "GPU", 0)]
    assert b.events[0].parent == 9 and b.dp_rank == 0


def test_sglang_batches_bytes_and_signed_hashes_and_salt_metadata():
    h = bytes(range(32))
    salted = ["BlockStored", [-3, -(2**63)], None, [1, 2, 3, 4], 2, None, "CPU_PINNED",
              {"cache_salt": "tenant-a"}]
    b = decode_batch(msgspec.msgpack.encode([5.0, [salted, ["BlockStored", [h], None, [], 1,
                                                            None]]]))  # no rank: [ts, events]
    s, t = b.events
    assert (s.hashes, s.medium, s.cache_salt, s.lora_name) == ([-3, -(2**63)], "CPU_PINNED",
                                                              "tenant-a", None)
    assert t.hashes == [h] and b.dp_rank == 0
    m = decode_batch(batch([stored([1], None, extra={"metadata": {"cache_salt": "x"}})]))
    assert m.events[0].cache_salt == "x"


@pytest.mark.parametrize("payload, words", [
    (b"\xc1garbage", "not msgpack"),
    (msgspec.msgpack.encode("hello"), "not an event batch"),
    (msgspec.msgpack.encode([1.0, [["Nope", [1]]]]), "unknown event type"),
    (msgspec.msgpack.encode([1.0, [["BlockRemoved", ["x"]]]]), "block_hashes"),
    (msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [], -4, None]]]), "block_size"),
    (msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [], "4", None]]]), "block_size"),
    (msgspec.msgpack.encode([1.0, [3]]), "not an array or map"),
])
def test_garbage_is_a_one_line_wire_error(payload, words):
    with pytest.raises(WireError, match=words) as info:
        decode_batch(payload)
    assert "\n" not in str(info.value)


def test_our_encoder_round_trips_in_both_layouts():
    b = Batch(2.5, [Stored([BIG, 3], 8, [], 16, "CPU", 2), Removed([3], "CPU", 2), Cleared()], 1)
    for layout in ("map", "array"):
        assert decode_batch(encode_batch(b, layout)) == b


def _b(events, rank=0, ts=0.0):
    return decode_batch(batch(events, rank=rank, ts=ts))


def test_mirror_refcounts_duplicate_stores_and_counts_orphans():
    m = Mirror()
    m.apply(_b([stored([1, 2, 3], None), stored([2], 1)]))  # a second physical copy of 2
    assert m.refs(0, 0, "GPU", 2) == 2 and m.health.duplicate_stores == 1
    m.apply(_b([removed([2])]))
    assert m.refs(0, 0, "GPU", 2) == 1 and m.num_resident == 3
    m.apply(_b([stored([10, 11], 99)]))  # parent 99 never seen: history missed
    assert m.health.orphans == 1
    assert m.tree() == {1: None, 2: 1, 3: 2, 10: 99, 11: 10}
    m.apply(_b([removed([2, 2, 42])], ts=7.9))
    assert m.health.unknown_removes == 2 and m.num_removed == 2 and m.evictions[7] == 1
    assert (m.num_stored, m.num_resident) == (6, 4)


def test_mirror_keeps_ranks_groups_and_media_apart():
    m = Mirror()
    m.apply(_b([stored([1, 2], None, group=0), stored([1], None, group=1, block_size=8),
                stored([1, 2], None, medium="CPU")], rank=0))
    m.apply(_b([stored([1], None)], rank=1))
    m.apply(_b([stored([5], 2, medium="CPU")]))  # parent resident on GPU and CPU: no orphan
    assert m.health.orphans == 0 and m.health.duplicate_stores == 0
    assert m.layers() == {(0, 0, "CPU"): (3, 12, 1), (0, 0, "GPU"): (2, 8, 1),
                          (0, 1, "GPU"): (1, 8, 1), (1, 0, "GPU"): (1, 4, 1)}
    m.apply(_b([removed([2])], rank=0))  # GPU copy gone; CPU copy keeps 5's parent resident
    assert m.layers()[(0, 0, "CPU")] == (3, 12, 1)
    m.apply(_b([cleared()], rank=0))  # rank 0 only
    assert m.layers() == {(1, 0, "GPU"): (1, 4, 1)} and m.num_cleared == 5
    m.apply(_b([stored([7], 1)], rank=0))
    assert m.health.orphans == 1  # rank 1's block 1 is not rank 0's parent


def test_summary_ends_with_the_counts_line():
    m = Mirror()
    m.apply(_b([stored([1, 2], None), removed([1]), stored([3], 77)]))
    last = m.summary().splitlines()[-1]
    assert last == ("blocks stored: 3, removed: 1, resident: 2, gaps: 0, repaired: 0, "
                    "orphans: 1, restarts: 0")
