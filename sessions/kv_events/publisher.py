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
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque

import zmq

from kvscope.engine import events as ev
from kvscope.engine.kv_groups import ONE_GROUP, KVGroup
from kvscope.sessions.kv_events.wire import END_SEQ, Batch, Cleared, Removed, Stored, encode_batch


class CachedHashes:
    """Physical block -> (KV group, short hash) of the blocks cached now, and how many blocks
    hold each (a hash recomputed while cached has copies), kept from the CACHED events seen:
    the engine's evictions name blocks, vLLM's name hashes in a group."""

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


def to_kv_events(events, cached: CachedHashes, block_size: int, medium: str,
                 groups: tuple[KVGroup, ...] = ONE_GROUP) -> list:
    """One step's engine events as vLLM events. A chain's first block is published with no parent
    when its parent is not a cached block of its group (our chains start from an identity root,
    vLLM's from None). Token ids are not published (the engine's events do not carry them)."""
    out = []
    for e in events:
        if e.kind == ev.CACHED:
            n, g = len(e.blocks), e.group
            spec = dict(group=g, spec_kind=groups[g].kind, sliding_window=groups[g].window)
            run: list[int] = []
            run_parent = None
            for block, h, parent in zip(e.blocks, e.hashes[:n], e.hashes[n:], strict=True):
                if not run or parent != run[-1]:  # a break in the chain starts a new store
                    if run:
                        out.append(Stored(run, run_parent, [], block_size, medium, **spec))
                    run, run_parent = [], parent if (g, parent) in cached.by_hash else None
                run.append(h)
                cached.add(block, g, h)
            if run:
                out.append(Stored(run, run_parent, [], block_size, medium, **spec))
        elif e.kind == ev.EVICTED:
            by_group: dict[int, list[int]] = {}  # the groups the blocks were cached in
            for g, h in filter(None, map(cached.pop, e.blocks)):
                by_group.setdefault(g, []).append(h)
            out += [Removed(hashes, medium, g) for g, hashes in by_group.items()]
        elif e.kind == ev.RESET:
            cached.clear()
            out.append(Cleared())
    return out


class KVEventPublisher:
    def __init__(self, engine, endpoint: str = "tcp://*:5557", replay: str | None = None,
                 topic: str = "", layout: str = "map", buffer_steps: int = 10_000,
                 dp_rank: int = 0, context: zmq.Context | None = None):
        self.engine, self.layout, self.dp_rank = engine, layout, dp_rank
        self.block_size = engine.config.block_size
        self.groups = engine.groups
        self.medium = "GPU" if engine.config.device == "cuda" else "CPU"
        self.topic = topic.encode()
        self._cached = CachedHashes()
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
        events = to_kv_events(update.events, self._cached, self.block_size, self.medium,
                              self.groups)
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
