"""A stand-in for a vLLM server's KV-event side made of vLLM's own parts: its KVCacheManager
makes the events and its ZmqEventPublisher publishes them (one batch per scheduler step, as
vllm/v1/core/sched/scheduler.py does), on a PUB port and a replay ROUTER port."""

from __future__ import annotations

import socket
import time

import vllm_ref as vr
from pool_sides import VllmSide


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_free(*ports: int, timeout_s: float = 5.0) -> None:
    """Until nothing listens on the ports: a closed ZMQ socket lets go of its port a moment
    after close() returns (its I/O thread closes it)."""
    deadline = time.monotonic() + timeout_s
    for port in ports:
        while True:
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine
                try:
                    s.bind(("", port))
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
            time.sleep(0.01)


class VllmServer:
    def __init__(self, num_blocks: int = 64, block_size: int = 16, port: int | None = None,
                 replay_port: int | None = None, topic: str = "", lookahead: int = 0,
                 windows: tuple = ()):
        """windows: KV-cache groups after a full-attention one, as sliding windows (VllmSide)."""
        self.port, self.replay_port = port or free_port(), replay_port or free_port()
        self.num_blocks, self.block_size, self.topic = num_blocks, block_size, topic
        self.lookahead, self.windows = lookahead, windows
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.replay = f"tcp://127.0.0.1:{self.replay_port}"
        self.publisher = None
        # What it published over all its lifetimes: block hashes stored and removed, resets.
        self.num_stored = self.num_removed = self.num_resets = 0
        self.start()

    def start(self) -> None:
        """A fresh server: an empty cache, and a publisher counting from sequence 0."""
        wait_free(self.port, self.replay_port)  # after a restart: the old sockets let go
        self.pending: list = []
        self.sent: list = []  # every event published, in order
        self.side = VllmSide(self.num_blocks, self.block_size, on_events=self.pending.extend,
                             lookahead=self.lookahead, windows=self.windows)
        self.num_batches = 0
        self.publisher = vr.ZmqEventPublisher(0, f"tcp://*:{self.port}",
                                              f"tcp://*:{self.replay_port}", topic=self.topic)

    def restart(self) -> None:
        self.publisher.shutdown()
        self.start()

    def step(self) -> None:
        """Publish what the calls since the last step produced, as one batch (none if none)."""
        if self.pending:
            for e in self.pending:
                if isinstance(e, vr.BlockStored):
                    self.num_stored += len(e.block_hashes)
                elif isinstance(e, vr.BlockRemoved):
                    self.num_removed += len(e.block_hashes)
                elif isinstance(e, vr.AllBlocksCleared):
                    self.num_resets += 1
            self.publisher.publish(vr.KVEventBatch(ts=time.time(), events=list(self.pending)))
            self.sent += self.pending
            self.pending.clear()
            self.num_batches += 1

    def wait_published(self, timeout_s: float = 5.0) -> None:
        """Until the publisher thread has sent everything queued."""
        deadline = time.monotonic() + timeout_s
        while self.publisher._event_queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.publisher.shutdown()
