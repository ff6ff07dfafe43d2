"""The host tier: a second pool of blocks in host memory behind the device pool. Torch-free.

As the offloading tiers of serving engines (vLLM's CPU offloading connector, LMCache, SGLang's
HiCache), by this rule: when a cached device block is evicted, its KV is copied to a host block
under the same hash (an offload: a copy, the hash is then resident on the host); a prefix lookup
that stops on the device goes on in the host tier (its pool's `prefix_hit`), and the blocks
found there are loaded back into fresh device blocks (registered on the device under their
hash) before the request's forward pass. The host pool is a `BlockPool` with its own eviction
policy: its evictions drop a hash for good. The chained hashes are the device's, identity
(model, adapter, salt) included.

KV-cache groups (engine.kv_groups): one host pool serves every group, as vLLM's CPU offloading
manager keys one pool by (block hash, group) (`make_offload_key`): a host block holds the key the
device block held (kv_groups.group_key), so an equal hash in two groups is two host blocks, and
one policy and one size govern the tier, as the device pool is shared by the groups. Offloads
and loads are emitted per group (`Event.group`), the host blocks taken for them counted in
that group.

The copies are made by the model runner before the step's forward pass, in this order: this
step's offloads (they read device blocks before anything overwrites them), then its loads. A
host block loaded in a step is held until the next step begins, so no offload of that step can
take it (and overwrite it) before it is read; the offloads a load's own device allocation
causes come after its LOADED event, so a replay, which holds the host blocks at that event,
holds them before those offloads as the engine did.
"""

from __future__ import annotations

from kvscope.engine import events as ev
from kvscope.engine.block_hash import short_hash
from kvscope.engine.block_pool import BlockPool


class HostTier:
    def __init__(self, num_blocks: int, device: BlockPool, log: ev.EventLog,
                 eviction_policy: str = "lru"):
        self.pool = BlockPool(num_blocks, eviction_policy=eviction_policy)
        self.device, self.log = device, log
        device.evicted_keys = []
        self.offloads: list[tuple[int, int]] = []  # this step: (device block, host block)
        self.loads: list[tuple[int, int]] = []  # this step: (host block, device block)
        self._held: list[int] = []  # host blocks loaded this step, held until the next
        self.hit_tokens = self.num_offloaded = self.num_loaded = 0  # (CacheCounters' host_*)

    def begin_step(self, step: int) -> None:
        """The previous step's copies are made: its loaded host blocks may be taken again."""
        if self._held:  # (in block order: a replay from a keyframe knows no other)
            self.pool.release(sorted(self._held), step)
        self._held, self.offloads, self.loads = [], [], []

    def offload_evicted(self, step: int, request_id: int | None) -> None:
        """Copy the device blocks just evicted to host blocks (a key the host holds already
        is not copied again). They join the host's queue in the order the device evicted them
        (a chain's tail first, as the device frees it), so the host too evicts a tail before
        its head; when the host cannot take them all (its blocks held this step), it takes
        the last evicted, the nearest their chains' heads. Each run of one group's blocks is
        one allocation in that group and one OFFLOADED event."""
        keys, self.device.evicted_keys = self.device.evicted_keys, []
        host = self.pool
        seen, last = set(host.hash_to_block), []  # (two device copies of a hash: one copy)
        for k in reversed(keys):
            if k[1] not in seen:
                seen.add(k[1])
                last.append(k)
        keys = last[::-1][max(0, len(last) - host.num_available):]
        while keys:
            g = keys[0][3]
            n = next((i for i, k in enumerate(keys) if k[3] != g), len(keys))
            self._offload(step, request_id, keys[:n], g)
            keys = keys[n:]

    def _offload(self, step: int, request_id: int | None, keys: list, group: int) -> None:
        host = self.pool
        got, evicted = host.allocate(len(keys), step, group)
        if evicted:
            self.log.emit(ev.HOST_EVICTED, step, request_id, evicted, group=group)
        for b, (_, h, parent, _) in zip(got, keys, strict=True):
            host.cache(b, h, parent, parent in self.device.chain_roots)
        host.release(got, step)
        sources = [k[0] for k in keys]
        self.offloads += zip(sources, got, strict=True)
        self.num_offloaded += len(got)
        if self.log.enabled:
            self.log.emit(ev.OFFLOADED, step, request_id, (*sources, *got),
                          hashes=(*(short_hash(k[1]) for k in keys),
                                  *(short_hash(k[2]) for k in keys)), group=group)

    def hold(self, step: int, host_blocks: list[int]) -> None:
        """Hold host blocks about to be loaded until the next step (before the device blocks
        they go to are allocated, whose evictions may offload)."""
        self.pool.take(host_blocks, step, hit=True)
        self._held += host_blocks

    def load(self, step: int, request_id: int, host_blocks: list[int], device_blocks: list[int],
             keys: list[bytes], parents: list[bytes], first: bool, group: int = 0) -> None:
        """Register `device_blocks` (fresh, held by the request, of `group`) under the keys the
        (held) host blocks hold, and queue the copies; `first`: the first of them opens its
        chain."""
        for i, (b, h, p) in enumerate(zip(device_blocks, keys, parents, strict=True)):
            self.device.cache(b, h, p, first and i == 0)
        self.loads += zip(host_blocks, device_blocks, strict=True)
        self.num_loaded += len(host_blocks)
        if self.log.enabled:
            self.log.emit(ev.LOADED, step, request_id, (*host_blocks, *device_blocks),
                          hashes=(*map(short_hash, keys), *map(short_hash, parents)),
                          group=group)
