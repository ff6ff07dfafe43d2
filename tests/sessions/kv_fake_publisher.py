"""A stand-in for a vLLM / SGLang KV-event publisher, written from the wire facts with raw pyzmq
and hand-built msgpack (not with kvscope's encoder): live frames [topic, seq (8 bytes BE),
payload], a ROUTER answering [b"", start_seq] in the old layout [b"", seq, payload] or the v0.26+
layout [b"", topic, seq, payload], then the end marker. Loopback only; every wait is bounded."""

from __future__ import annotations

import threading
import time

import msgspec
import zmq

END = b"\xff" * 8


def stored(hashes, parent, *, block_size=4, medium="GPU", group=None, layout="map", tokens=None,
           lora_name=None, extra=None, kind=None, window=None):
    """kind, window: the group's kv_cache_spec_kind and kv_cache_spec_sliding_window (vLLM
    0.33 sends both, the window None for a kind without one)."""
    tokens = tokens if tokens is not None else list(range(block_size * len(hashes)))
    if layout == "array":  # v0.9 field order; group_idx, then the spec, after extra_keys
        tail = [lora_name]
        if group is not None or kind is not None:
            tail += [None, group] + ([kind, window] if kind is not None else [])
        return ["BlockStored", hashes, parent, tokens, block_size, None, medium, *tail]
    e = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
         "token_ids": tokens, "block_size": block_size, "lora_id": None, "medium": medium,
         "lora_name": lora_name}
    if group is not None:
        e["group_idx"] = group
    if kind is not None:
        e["kv_cache_spec_kind"], e["kv_cache_spec_sliding_window"] = kind, window
    e.update(extra or {})
    return e


def removed(hashes, *, medium="GPU", group=None, layout="map"):
    if layout == "array":
        return ["BlockRemoved", hashes, medium] + ([group] if group is not None else [])
    e = {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
    if group is not None:
        e["group_idx"] = group
    return e


def cleared(layout="map"):
    return ["AllBlocksCleared"] if layout == "array" else {"type": "AllBlocksCleared"}


def batch(events, rank=0, layout="map", ts=1000.0) -> bytes:
    if layout == "array":
        return msgspec.msgpack.encode([ts, events, rank])
    return msgspec.msgpack.encode({"ts": ts, "events": events, "data_parallel_rank": rank})


class FakePublisher:
    def __init__(self, topic: bytes = b"", replay_layout: str = "old"):
        self.ctx = zmq.Context()
        self.topic, self.replay_layout = topic, replay_layout
        self.pub = self.ctx.socket(zmq.XPUB)  # XPUB: we can wait for the subscriber to join
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        self.replay_endpoint = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.buffer: list[tuple[int, bytes]] = []  # what replay can return
        self.replay_requests: list[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def wait_subscribed(self, timeout_s: float = 5.0) -> None:
        if not self.pub.poll(int(timeout_s * 1000)):
            raise TimeoutError("no subscriber joined")
        self.pub.recv()

    def wait_replay_requests(self, n: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.replay_requests) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(self.replay_requests) >= n, self.replay_requests

    def send(self, seq: int, payload: bytes, *, live: bool = True, keep: bool = True) -> None:
        """live: send on PUB; keep: put in the replay buffer."""
        if keep:
            with self._lock:
                self.buffer.append((seq, payload))
        if live:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def send_frames(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            client, empty, start = self.router.recv_multipart()
            assert empty == b"" and len(start) == 8
            start_seq = int.from_bytes(start, "big")
            with self._lock:
                items = [(s, p) for s, p in self.buffer if s >= start_seq]
            self.replay_requests.append(start_seq)  # after the buffer was read
            for seq, payload in items:
                head = [client, b""] + ([self.topic] if self.replay_layout == "new" else [])
                self.router.send_multipart(head + [seq.to_bytes(8, "big"), payload])
            end = [client, b""] + ([b""] if self.replay_layout == "new" else [])
            self.router.send_multipart(end + [END, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


def drain(attachment, until_seq: int, messages: int = 0, timeout_s: float = 5.0) -> None:
    """Poll until the attachment has applied until_seq and received `messages` live messages."""
    deadline = time.monotonic() + timeout_s
    while (attachment.last < until_seq or attachment.num_messages < messages) and \
            time.monotonic() < deadline:
        attachment.poll(20)
    assert attachment.last >= until_seq, f"applied up to {attachment.last}, wanted {until_seq}"
    assert attachment.num_messages >= messages
