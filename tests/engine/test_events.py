"""Typed events: every kind is an EventKind, and each kind's fields are read by name."""

from __future__ import annotations

import pytest

from kvscope.engine import KVCacheManager
from kvscope.engine import events as ev


def test_copy_on_write_and_cached_fields_are_named_and_match_the_pool():
    mgr = KVCacheManager(num_blocks=16, block_size=4)
    mgr.admit(1, list(range(10)))  # two full blocks and a partial third
    mgr.fork(1, 2)
    mgr.append_token_ids(2, [99])
    copies = mgr.allocate(2, 1)  # the child writes into the shared partial block
    events = mgr.events.drain()
    assert all(isinstance(e.kind, ev.EventKind) for e in events)
    (cow,) = [e for e in events if e.kind == ev.COW]
    assert [(cow.src_block, cow.dst_block)] == copies
    assert mgr.block_table(2)[2] == cow.dst_block and mgr.block_table(1)[2] == cow.src_block
    (cached,) = [e for e in events if e.kind == ev.CACHED]
    snap = mgr.snapshot()
    assert list(cached.block_hashes) == [int(snap.block_hash[b]) for b in cached.blocks]
    assert list(cached.parent_hashes) == [int(snap.parent_hash[b]) for b in cached.blocks]
    # The chain: the second block's parent is the first block's hash.
    assert cached.parent_hashes[1] == cached.block_hashes[0]
    with pytest.raises(ValueError, match="no such field"):
        _ = cached.src_block


def test_kinds_print_and_compare_as_their_names():
    assert ev.CACHED == "cached" and str(ev.CACHED) == "cached" and f"{ev.FREED}" == "freed"
    assert ev.EventKind("uncached") is ev.UNCACHED
    assert set(ev.BLOCK_EVENTS) | set(ev.HOST_EVENTS) | set(ev.REQUEST_EVENTS) == set(ev.EventKind)
