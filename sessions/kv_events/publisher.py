"""Our engine publishes its prefix cache as vLLM KV events, so that anything that attaches to vLLM
(kvscope included) can attach to it.

    pub = KVEventPublisher(engine, "tcp://*:5557", replay="tcp://*:5558")
    ...  # engine.step() as usual: each step's cache changes go out as one batch
    pub.close()

Wire as vLLM's ZmqEventPublisher: PUB frames [topic, seq (8 bytes BE), payload]; a ROUTER on the
replay endpoint answers [b"", start_seq] with [b"", seq, payload] per buffered batch (the
pre-v0.26 layout, also SGLang's) and the end marker [b"", ff x 8, b""]. An endpoint with `*`, `::`
or an ipc/inproc scheme is bound, any other is connected to, as vLLM does.

Every BlockStored names its KV group as vLLM 0.33 does, one-group engines included: `group_idx`,
`kv_cache_spec_kind` ("full_attention" or "sliding_window") and `kv_cache_spec_sliding_window`
(the window in tokens, None for full attention); a BlockRemoved names its `group_idx`.

Tiers by vLLM's `medium`: the device tier is "GPU" even on a CPU build (vLLM's word for the tier
next to the compute, not for the chip: the host tier is "CPU", and a CPU build's device tier
named "CPU" would collide with it, so consumers could not tell a block's copies apart); an engine
with a host tier (`EngineConfig(host_blocks=N)`) publishes it as "CPU" (see `to_kv_events`).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque

import zmq

from kvscope.engine import events as ev
from kvscope.engine.kv_groups import ONE_GROUP, KVGroup
from kvscope.sessions.kv_events.wire import END_SEQ, Batch, Cleared, Removed, Stored, encode_batch

DEVICE_MEDIUM = "GPU"  # vLLM's medium of the device tier, whatever the device
HOST_MEDIUM = "CPU"  # vLLM's medium of the host tier (its offloading connector's CPU tier)


class CachedHashes:
    """Physical block -> (KV group, short hash) of the blocks of one tier that hold a hash now,
    and how many blocks hold each (a hash recomputed while cached has copies), kept from the
    events seen: the engine's evictions name blocks, vLLM's name hashes in a group."""

    def __init__(self):
        self.by_block: dict[int, tuple[int, int]] = {}
        self.by_hash: Counter[tuple[int, int]] = Counter()

    def add(self, block: int, group: int, h: int) -> None:
        self.by_block[block] = (group, h)
        self.by_hash[(group, h)] += 1

    def pop(self, block: int) -> tuple[int, int] | None:
        key = self.by_block.pop(block, None)
        if key is not None:
            self.by_hash[key] -= 1
            if not self.by_hash[key]:
                del self.by_hash[key]
        return key

    def clear(self) -> None:
        self.by_block.clear()
        self.by_hash.clear()


class TierHashes:
    """The published hashes of the device tier and, for an engine with one, the host tier."""

    def __init__(self, host: bool = False):
        self.device = CachedHashes()
        self.host = CachedHashes() if host else None

    def resident(self, group: int, h: int) -> bool:
        """Whether a block of `group` holds hash `h` in any tier."""
        return (group, h) in self.device.by_hash or \
            (self.host is not None and (group, h) in self.host.by_hash)


def to_kv_events(events, tiers: TierHashes, block_size: int,
                 groups: tuple[KVGroup, ...] = ONE_GROUP) -> list:
    """One step's engine events as vLLM events. A chain's first block is published with no parent
    when its parent is held by no block of its group in any tier (our chains start from an
    identity root, vLLM's from None). Token ids are not published (the engine's events do not
    carry them).

    The host tier as vLLM's offloading connector publishes its CPU tier: an offload (a copy of
    an evicted device block) is a BlockStored of medium "CPU" naming the copies' hashes and
    parents and the block size as a device store does: vLLM 0.33's self-describing form
    (`self_describing_kv_events`), not its default placeholder (no parent, block_size 0, one
    store per chunk), since the engine knows the chain and a consumer can then place the host's
    blocks in their prefix trees. A host eviction is a BlockRemoved of medium "CPU" naming the
    hashes its stores named; a load back is an ordinary "GPU" store of the device blocks it
    registers (vLLM has no "moved" event), the host copy staying.

    A prefix-cache reset publishes AllBlocksCleared on a one-tier engine. With a host tier it
    clears the device only, so it is published as the device's removals: AllBlocksCleared names
    no tier, and consumers (kvscope's mirror, llm-d) drop every tier on it."""
    out = []
    device, host = tiers.device, tiers.host
    for e in events:
        kind = e.kind
        if kind == ev.CACHED:
            out += _stores(e.blocks, e.hashes, e.group, DEVICE_MEDIUM, device, tiers,
                           block_size, groups)
        elif kind == ev.LOADED:
            out += _stores(e.destinations, e.hashes, e.group, DEVICE_MEDIUM, device, tiers,
                           block_size, groups)
        elif kind == ev.OFFLOADED and host is not None:
            out += _stores(*_chain_order(e.destinations, e.hashes), e.group, HOST_MEDIUM, host,
                           tiers, block_size, groups)
        elif kind in (ev.EVICTED, ev.UNCACHED):  # UNCACHED: a failed step's registrations
            out += _removals(e.blocks, device, DEVICE_MEDIUM)
        elif kind == ev.HOST_EVICTED and host is not None:
            out += _removals(e.blocks, host, HOST_MEDIUM)
        elif kind == ev.RESET:
            if host is None:
                device.clear()
                out.append(Cleared())
            else:
                out += _removals(list(device.by_block), device, DEVICE_MEDIUM)
    return out


def _stores(blocks, hashes, group: int, medium: str, tier: CachedHashes, tiers: TierHashes,
            block_size: int, groups: tuple[KVGroup, ...]) -> list[Stored]:
    """`blocks` (of `tier`) now hold `hashes` (the blocks' short hashes, then their parents'):
    one store per unbroken chain."""
    n, out = len(blocks), []
    spec = dict(group=group, spec_kind=groups[group].kind, sliding_window=groups[group].window)
    run: list[int] = []
    run_parent = None
    for block, h, parent in zip(blocks, hashes[:n], hashes[n:], strict=True):
        if not run or parent != run[-1]:  # a break in the chain starts a new store
            if run:
                out.append(Stored(run, run_parent, [], block_size, medium, **spec))
            run, run_parent = [], parent if tiers.resident(group, parent) else None
        run.append(h)
        tier.add(block, group, h)
    if run:
        out.append(Stored(run, run_parent, [], block_size, medium, **spec))
    return out


def _chain_order(blocks, hashes) -> tuple[list, list]:
    """(blocks, hashes) with each block after its parent where both are among them: an offload
    copies the evicted blocks tail first, and a chain is published head first, as one store."""
    n = len(blocks)
    first: dict[int, int] = {}
    for i, h in enumerate(hashes[:n]):
        first.setdefault(h, i)
    children: dict[int, list[int]] = {}
    stack = []
    for i, parent in enumerate(hashes[n:]):
        j = first.get(parent)
        if j is None or j == i:
            stack.append(i)
        else:
            children.setdefault(j, []).append(i)
    order: list[int] = []
    stack.reverse()
    while stack:
        i = stack.pop()
        order.append(i)
        stack += reversed(children.get(i, ()))
    if len(order) != n:  # (never: a hash is not its own ancestor)
        order = list(range(n))
    return [blocks[i] for i in order], [hashes[i] for i in order] + \
        [hashes[n + i] for i in order]


def _removals(blocks, tier: CachedHashes, medium: str) -> list[Removed]:
    """`blocks` of `tier` no longer hold their hashes: one removal per group they were in."""
    by_group: dict[int, list[int]] = {}
    for g, h in filter(None, map(tier.pop, blocks)):
        by_group.setdefault(g, []).append(h)
    return [Removed(hashes, medium, g) for g, hashes in by_group.items()]


class KVEventPublisher:
    def __init__(self, engine, endpoint: str = "tcp://*:5557", replay: str | None = None,
                 topic: str = "", layout: str = "map", buffer_steps: int = 10_000,
                 dp_rank: int = 0, context: zmq.Context | None = None):
        self.engine, self.layout, self.dp_rank = engine, layout, dp_rank
        self.block_size = engine.config.block_size
        self.groups = engine.groups
        self.topic = topic.encode()
        self._tiers = TierHashes(host=bool(engine.config.host_blocks))
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0  # the next sequence number
        self.num_blocks_published = 0
        ctx = context or zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = _open(self._pub, endpoint)
        self._router = self.replay_endpoint = self._thread = None
        self._stop = threading.Event()
        if replay:
            self._router = ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(replay)
            self.replay_endpoint = _last_endpoint(self._router)
            self._thread = threading.Thread(target=self._serve_replay, daemon=True,
                                            name="kv-events-replay")
            self._thread.start()
        engine.subscribe(self.on_step)

    def on_step(self, update) -> None:
        """The step listener: the one place that reads the engine's step stream."""
        events = to_kv_events(update.events, self._tiers, self.block_size, self.groups)
        if events:
            self.publish(Batch(time.time(), events, self.dp_rank))

    def publish(self, batch: Batch) -> None:
        payload = encode_batch(batch, self.layout)
        seq = self.seq.to_bytes(8, "big")
        self._buffer.append((self.seq, payload))
        self._pub.send_multipart([self.topic, seq, payload])
        self.seq += 1
        self.num_blocks_published += sum(len(getattr(e, "hashes", ())) for e in batch.events)

    def close(self) -> None:
        self.engine.unsubscribe(self.on_step)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._pub.close(linger=0)

    def _serve_replay(self) -> None:
        router = self._router
        try:
            while not self._stop.is_set():
                if not router.poll(50):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    continue  # not a replay request
                client, start = frames[0], int.from_bytes(frames[2], "big")
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
                router.send_multipart([client, b"", END_SEQ, b""])
        finally:
            router.close(linger=0)


def _open(sock: zmq.Socket, endpoint: str) -> str:
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
        return _last_endpoint(sock)
    sock.connect(endpoint)
    return endpoint


def _last_endpoint(sock: zmq.Socket) -> str:
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()
