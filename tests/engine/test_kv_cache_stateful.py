"""Random admit / append / fork / free / cancel / reset sequences against the cache manager,
under each eviction policy, with a host tier, and with a host tier and KV-cache groups.

Besides the bookkeeping invariants, a shadow KV store plays the model runner: it performs the
copy-on-write copies and writes each computed token into its slot. Every request must then read
back exactly its own tokens through its block table, which is what makes sharing correct.
"""

import dataclasses
import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvscope.engine import KVCacheManager, NoFreeBlocksError
from kvscope.engine.kv_groups import NULL, ONE_GROUP, KVGroup, group_key
from kvscope.sessions.replay import PoolReplay

BLOCK_SIZE = 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9], [7] * 13, []]


class CacheMachine(RuleBasedStateMachine):
    policy = "lru"
    host_blocks = 0
    num_device_blocks = 12
    groups = ONE_GROUP

    def __init__(self):
        super().__init__()
        self.num_blocks = self.num_device_blocks
        self.mgr = KVCacheManager(self.num_blocks, BLOCK_SIZE, model_fingerprint="m",
                                  eviction_policy=self.policy, host_blocks=self.host_blocks,
                                  groups=self.groups)
        self.released_at: dict[int, int] = {}  # block -> when it was last released (for lru)
        release, clock = self.mgr.pool.release, itertools.count()

        def note_release(blocks, step):
            for b in blocks:
                self.released_at[b] = next(clock)
            release(blocks, step)

        self.mgr.pool.release = note_release
        self.kv = [[None] * BLOCK_SIZE for _ in range(self.num_blocks)]  # shadow KV contents
        self.next_id = 0
        self.ops = 0

    def _write(self, rid, start, copies):
        self._transfer()
        for src, dst in copies:
            self.kv[dst] = list(self.kv[src])
        seq = self.mgr.seqs[rid]
        for table in seq.tables:
            for pos in range(start, seq.num_computed):
                block = table[pos // BLOCK_SIZE]
                if block != NULL:
                    self.kv[block][pos % BLOCK_SIZE] = seq.token_ids[pos]

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 3), max_size=6),
          salt=st.sampled_from([None, "tenant-b"]), chunk=st.none() | st.integers(1, 6))
    def admit(self, prefix, suffix, salt, chunk):
        tokens = prefix + suffix or [0]
        rid = self.next_id
        self.next_id += 1
        fits = self.mgr.can_admit(tokens, chunk or len(tokens), cache_salt=salt)
        cached = self.mgr.admit(rid, tokens, chunk, cache_salt=salt)
        assert (cached is not None) == fits
        if cached is not None:
            assert cached % BLOCK_SIZE == 0 and cached < len(tokens)
            self._write(rid, cached, [])
        self.ops += 1

    @precondition(lambda self: self.mgr.seqs)
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), max_size=5), n=st.integers(1, 6))
    def append(self, data, new, n):
        rid = data.draw(st.sampled_from(sorted(self.mgr.seqs)))
        self.mgr.append_token_ids(rid, new)
        seq = self.mgr.seqs[rid]
        n = min(n, len(seq.token_ids) - seq.num_computed)
        start = seq.num_computed
        fits = self.mgr.can_allocate(rid, n)
        try:
            copies = self.mgr.allocate(rid, n)
        except NoFreeBlocksError:
            assert not fits
            assert seq.num_computed == start
        else:
            assert fits
            self._write(rid, start, copies)
        self.ops += 1

    @precondition(lambda self: self.mgr.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.mgr.seqs)))
        self.mgr.fork(parent, self.next_id)
        self.next_id += 1
        self.ops += 1

    @precondition(lambda self: self.mgr.seqs)
    @rule(data=st.data())
    def free(self, data):  # finished, cancelled or preempted: the manager does not care which
        self.mgr.free(data.draw(st.sampled_from(sorted(self.mgr.seqs))))
        self.ops += 1

    @rule()
    def reset(self):
        self.mgr.reset_prefix_cache()
        self.ops += 1

    @rule()
    def next_step(self):
        self.mgr.step += 1

    def _transfer(self) -> None:
        """The host tier's copies queued since the last ones made (none without a tier)."""

    @invariant()
    def bookkeeping(self):
        mgr, pool = self.mgr, self.mgr.pool
        refs = [0] * self.num_blocks
        for seq in mgr.seqs.values():
            for b in (b for t in seq.tables for b in t if b != NULL):
                refs[b] += 1
        assert refs == pool.ref_count
        assert all(refs[b] == 0 for b in pool.free_queue)
        assert len(pool.free_queue) == sum(r == 0 for r in refs)
        holders = {}  # hash -> every block holding it, in registration order
        for h, b in pool.hash_to_block.items():
            holders[h] = [b, *pool.copies.get(h, [])]
        assert set(pool.copies) <= set(pool.hash_to_block)
        for h, blocks in holders.items():
            assert all(pool.block_hash[b] == h for b in blocks) and blocks
            seqs = [pool.cached_seq[b] for b in blocks]
            assert seqs == sorted(seqs)  # a lookup takes the earliest registered copy
        assert sorted(b for bs in holders.values() for b in bs) == \
            [b for b, h in enumerate(pool.block_hash) if h is not None]
        snap = mgr.snapshot()
        assert (snap.num_free_blocks + snap.num_active_blocks + snap.num_cached_blocks
                == self.num_blocks)
        assert snap.num_cached_blocks == pool.num_cached == sum(
            1 for b in pool.free_queue if pool.block_hash[b] is not None)

    @invariant()
    def eviction_order_follows_the_policy(self):
        pool = self.mgr.pool
        order = pool.eviction_order()
        hashed = [pool.block_hash[b] is not None for b in order]
        assert hashed == sorted(hashed), "a plain free block waits behind a cached one"
        cached = order[hashed.count(False):]
        if self.policy == "fifo":
            keys = [pool.cached_seq[b] for b in cached]
        elif self.policy == "lfu":
            keys = [pool.hits[b] for b in cached]
        else:
            keys = [self.released_at[b] for b in cached]
        assert keys == sorted(keys)

    @invariant()
    def every_request_reads_its_own_tokens(self):
        """In each group, every position a later query may attend (a window's: those after
        the tokens it skips) is in a block holding its token."""
        for seq in self.mgr.seqs.values():
            for group, table in zip(self.groups, seq.tables, strict=True):
                assert len(table) == -(-seq.num_computed // BLOCK_SIZE)
                for pos in range(group.skipped_tokens(seq.num_computed), seq.num_computed):
                    assert self.kv[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE] == \
                        seq.token_ids[pos]

    def teardown(self):
        for rid in list(self.mgr.seqs):
            self.mgr.free(rid)
        snap = self.mgr.snapshot()
        assert snap.num_active_blocks == 0
        assert snap.ref_count.sum() == 0
        TOTAL_OPS.append(self.ops)


class HostMachine(CacheMachine):
    """A host tier of 3 blocks behind 5 (evictions come often): its shadow store takes the
    offloads and gives the loads back, so a request that hit from the host reads its own tokens
    only if the right KV came back; and every host block holds the tokens of its hash (no copy
    lost or mixed)."""

    host_blocks, num_device_blocks = 3, 5

    def __init__(self):
        super().__init__()
        self.host_kv = [None] * self.host_blocks
        self.seen: list[list[int]] = []  # prompts admitted by admit_and_finish
        self.done = (0, 0)  # offloads and loads of this step already made
        self.tokens_of: dict = {}  # (group) key -> the tokens it stands for
        self.replay = PoolReplay(self.mgr.snapshot(), self.policy)  # driven by the events

    def _transfer(self) -> None:
        host = self.mgr.host
        o, n = self.done
        for d, h in host.offloads[o:]:
            self.host_kv[h] = list(self.kv[d])
        for h, d in host.loads[n:]:
            self.kv[d] = list(self.host_kv[h])
        self.done = (len(host.offloads), len(host.loads))
        for seq in self.mgr.seqs.values():
            for i in range(seq.num_registered):
                for g in range(len(self.groups)):
                    self.tokens_of[group_key(seq.hashes[i], g)] = \
                        seq.token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]

    @rule()
    def next_step(self):
        self.mgr.begin_step(self.mgr.step + 1)
        self.done = (0, 0)

    @rule(tokens=st.lists(st.integers(100, 10**6), min_size=4, max_size=13),
          again=st.booleans())
    def admit_and_finish(self, tokens, again):
        """A prompt of its own (pressure: evictions to the host) or one seen before (a hit,
        from either tier), admitted and freed at once, as a short request."""
        if again and self.seen:
            tokens = self.seen[len(tokens) % len(self.seen)]
        rid = self.next_id
        self.next_id += 1
        if self.mgr.admit(rid, tokens) is not None:
            self._write(rid, 0, [])
            self.mgr.free(rid)
            self.seen.append(tokens)
        self.ops += 1

    @invariant()
    def the_host_tier_keeps_each_hash_once_with_its_tokens(self):
        pool = self.mgr.host.pool
        assert not pool.copies  # a hash the host holds is not copied again
        assert sorted(pool.hash_to_block.values()) == \
            [b for b, h in enumerate(pool.block_hash) if h is not None]
        held = sum(pool.ref_count)
        assert held == len(self.mgr.host._held)
        for h, b in pool.hash_to_block.items():
            assert self.host_kv[b] == self.tokens_of[h], (b, h)

    @invariant()
    def the_events_replay_to_the_same_pools(self):
        """Both pools and every table rebuilt from the events alone (as a session's replay)."""
        mgr, replay = self.mgr, self.replay
        for e in mgr.events.drain():
            replay.apply_event(e)
        replay.end_step(mgr.step, mgr.num_computed(), dataclasses.asdict(mgr.counters()))
        assert replay.snapshot().equals(mgr.snapshot())

    def teardown(self):
        super().teardown()
        self.mgr.begin_step(self.mgr.step + 1)
        assert sum(self.mgr.host.pool.ref_count) == 0
        c = self.mgr.counters()
        (GROUP_HOST_COPIES if len(self.groups) > 1 else HOST_COPIES).append(
            (c.num_offloaded_blocks, c.num_loaded_blocks, c.num_host_evicted_blocks))


HOST_COPIES: list[tuple[int, int, int]] = []  # per run: offloaded, loaded, host-evicted blocks
GROUP_HOST_COPIES: list[tuple[int, int, int]] = []  # the same, with two KV-cache groups


class GroupHostMachine(HostMachine):
    """The host tier behind a hybrid model: full attention and a 6-token window (it needs 2
    blocks before a hit; its blocks leave the table mid-request), one shared host pool keyed
    by (group, hash): every copy's tokens checked, both pools replayed from the events."""

    groups = (KVGroup(), KVGroup(window=6))
    host_blocks, num_device_blocks = 5, 10

    @invariant()
    def the_host_keeps_each_groups_key_in_that_group(self):
        pool = self.mgr.host.pool
        for k, b in pool.hash_to_block.items():
            assert pool.group[b] == (k[-1] if len(k) == 33 else 0)


TOTAL_OPS: list[int] = []
MIN_OPS = 10_000
# Long runs: per operation, Hypothesis's own drawing dominates (~1.5 ms), and fewer, longer
# examples spend less of it per operation (100 x 150 steps: ~10,000 operations in ~13 s on
# one core).
CacheMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=150,
                                          deadline=None)
TestCacheMachine = CacheMachine.TestCase


class FifoMachine(CacheMachine):
    policy = "fifo"


class LfuMachine(CacheMachine):
    policy = "lfu"


for _m in (FifoMachine, LfuMachine):
    _m.TestCase.settings = settings(max_examples=60, stateful_step_count=50, deadline=None)
HostMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=100, deadline=None)
GroupHostMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=100,
                                              deadline=None)
TestGroupHostMachine = GroupHostMachine.TestCase
TestFifoMachine, TestLfuMachine = FifoMachine.TestCase, LfuMachine.TestCase
TestHostMachine = HostMachine.TestCase


def test_enough_operations_ran():
    """At least MIN_OPS operations per run, with the shadow-store check after each: the count
    per run varies (examples end early at random), so top up with short extra runs."""
    if not TOTAL_OPS:  # run on its own: drive the machine here
        TestCacheMachine("runTest").runTest()
    while sum(TOTAL_OPS) < MIN_OPS:
        run_state_machine_as_test(CacheMachine, settings=settings(
            CacheMachine.TestCase.settings, max_examples=20))
    assert sum(TOTAL_OPS) >= MIN_OPS, sum(TOTAL_OPS)


def test_the_host_machines_offload_load_and_evict_on_the_host():
    """The checks above saw every kind of host copy (not a tier that stayed idle), with one
    KV-cache group and with two."""
    if not HOST_COPIES:
        TestHostMachine("runTest").runTest()
    if not GROUP_HOST_COPIES:
        TestGroupHostMachine("runTest").runTest()
    for copies in (HOST_COPIES, GROUP_HOST_COPIES):
        assert all(sum(c[k] for c in copies) > 0 for k in range(3)), copies
