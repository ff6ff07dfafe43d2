"""The attach transport: a SUB socket on the live stream, a DEALER asking the replay endpoint for
what was missed (on attach, and on every sequence gap), feeding a Mirror in sequence order.

Sequence numbers count batches from 0 per publisher; a live sequence that goes back means the
publisher restarted: its ranks are cleared from the mirror and history is asked for again.
Nothing here blocks for longer than the timeouts given; bad frames are counted and noted.
"""

from __future__ import annotations

import time

import zmq

from kvscope.sessions.kv_events.mirror import Mirror
from kvscope.sessions.kv_events.wire import END_SEQ, WireError, decode_batch

MAX_REPLAY_BATCHES = 1_000_000  # a bound on one replay reply (vLLM keeps 10,000 batches)
MAX_DRAIN = 10_000  # live messages handled per poll before returning to the caller
SCHEMES = ("tcp://", "ipc://", "inproc://")


class Attachment:
    def __init__(self, endpoint: str, replay: str | None = None, topic: str = "",
                 mirror: Mirror | None = None, replay_timeout_s: float = 1.0,
                 context: zmq.Context | None = None):
        for name, value in (("endpoint", endpoint), ("replay endpoint", replay)):
            if value is not None and not value.startswith(SCHEMES):
                raise ValueError(f"{name} {value!r} is not a ZMQ address "
                                 "(tcp://HOST:PORT, ipc://PATH)")
        self.endpoint, self.replay, self.topic = endpoint, replay, topic
        self.mirror = mirror or Mirror()
        self.health = self.mirror.health
        self.replay_timeout_s = replay_timeout_s
        self.ctx = context or zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 0)  # never drop on our side: gaps are the server's
        try:
            self.sub.connect(endpoint)
        except zmq.ZMQError as e:
            self.sub.close()
            raise ValueError(f"cannot connect to {endpoint}: {e}") from None
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.last = -1  # highest sequence applied to the mirror
        self.live_last = -1  # highest sequence seen on the live socket
        self.ranks: set[int] = set()  # data-parallel ranks this stream published
        self.num_messages = 0  # live messages received, good or bad

    # ------------------------------------------------------------------ driving
    def start(self) -> Attachment:
        """Ask the replay endpoint for its history (up to its buffer) before going live."""
        if self.replay:
            self._replay_from(0)
        return self

    def poll(self, timeout_ms: int = 0) -> int:
        """Handle the live messages that arrive within timeout_ms (at most MAX_DRAIN)."""
        n = 0
        if not self.sub.poll(timeout_ms):
            return 0
        while n < MAX_DRAIN:
            try:
                frames = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._on_live(frames)
            n += 1
        return n

    def close(self) -> None:
        self.sub.close(linger=0)

    # ------------------------------------------------------------------ live stream
    def _on_live(self, frames: list[bytes]) -> None:
        self.num_messages += 1
        if len(frames) != 3 or len(frames[1]) != 8:
            self._bad(f"a {len(frames)}-frame message: not a vLLM/SGLang KV-event stream "
                      "(expected topic, 8-byte sequence, payload)")
            return
        seq = int.from_bytes(frames[1], "big")
        if seq <= self.live_last:
            self._restart(seq)
        self.live_last = seq
        if seq <= self.last:
            return  # already applied through replay
        if seq > self.last + 1:
            self._fill(seq)
            if seq <= self.last:  # the replay reply reached it
                return
        self._apply(seq, frames[2])

    def _restart(self, seq: int) -> None:
        self.health.restarts += 1
        self.health.note(f"publisher restarted (sequence {self.live_last} -> {seq}): "
                         "its blocks were dropped from the mirror")
        for rank in self.ranks:
            self.mirror.clear(rank)
        self.last = -1

    def _fill(self, seq: int) -> None:
        """Batches last+1 .. seq-1 were not received: history (nothing applied yet) or a gap."""
        start, is_gap = self.last + 1, self.last >= 0
        if is_gap:
            self.health.gaps += 1
            self.health.missing += seq - start
        got = self._replay_from(start, until=seq - 1) if self.replay else 0
        if not is_gap:
            return
        if got == seq - start:
            self.health.repaired += 1
        else:
            self.health.lost += seq - start - got
            self.health.note(f"gap: batches {start}..{seq - 1}, {got} recovered by replay"
                             + ("" if self.replay else " (no --replay endpoint)"))

    def _apply(self, seq: int, payload: bytes) -> bool:
        self.last = seq
        try:
            batch = decode_batch(payload)
        except WireError as e:
            self._bad(f"sequence {seq}: payload is not a KV-event batch: {e}")
            return False
        self.health.first_seq.setdefault(self.endpoint, seq)
        self.ranks.add(batch.dp_rank)
        self.mirror.apply(batch)
        return True

    def _bad(self, text: str) -> None:
        self.health.bad_messages += 1
        self.health.note(text)

    # ------------------------------------------------------------------ replay
    def _replay_from(self, start: int, until: int | None = None) -> int:
        """Apply what the replay endpoint returns from `start` on (up to `until`); returns the
        number of batches applied."""
        dealer = self.ctx.socket(zmq.DEALER)  # one per request: no stale replies after a timeout
        dealer.setsockopt(zmq.LINGER, 0)
        got = 0
        try:
            dealer.connect(self.replay)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            for _ in range(MAX_REPLAY_BATCHES):
                if not dealer.poll(int(self.replay_timeout_s * 1000)):
                    self.health.note(f"replay endpoint {self.replay} did not finish its reply "
                                     f"within {self.replay_timeout_s:g} s")
                    break
                frames = dealer.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3:  # vLLM v0.26+: topic, seq, payload
                    frames = frames[1:]
                if len(frames) != 2 or len(frames[0]) != 8:
                    self._bad(f"replay endpoint sent a {len(frames)}-frame reply: not a "
                              "vLLM/SGLang replay endpoint")
                    break
                if frames[0] == END_SEQ:
                    break
                seq = int.from_bytes(frames[0], "big")
                # On a gap, batches after it are left to the live stream, which has them.
                if self.last < seq and (until is None or seq <= until) and \
                        self._apply(seq, frames[1]):
                    self.health.replayed += 1
                    got += 1
        except zmq.ZMQError as e:
            self.health.note(f"replay from {self.replay} failed: {e}")
        finally:
            dealer.close(linger=0)
        return got


def listen(attachments: list[Attachment], duration_s: float) -> None:
    """Drive several attachments (one per data-parallel rank) for duration_s seconds."""
    poller = zmq.Poller()
    for a in attachments:
        poller.register(a.sub, zmq.POLLIN)
    deadline = time.monotonic() + duration_s
    while (left := deadline - time.monotonic()) > 0:
        ready = dict(poller.poll(int(min(left, 0.1) * 1000) + 1))
        for a in attachments:
            if a.sub in ready:
                a.poll(0)


def rank_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's rule: data-parallel rank r publishes on the endpoint's port + r."""
    head, _, port = endpoint.rpartition(":")
    if rank and not (endpoint.startswith("tcp://") and port.isdigit()):
        raise ValueError(f"cannot find data-parallel rank {rank}'s port from {endpoint} "
                         "(needs tcp://HOST:PORT)")
    return f"{head}:{int(port) + rank}" if rank else endpoint
