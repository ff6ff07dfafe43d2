"""The attach transport: a SUB socket on the live stream, a DEALER asking the replay endpoint for
what was missed (on attach, on every sequence gap, and on reconnecting after a disconnect),
feeding a Mirror in sequence order.

Sequence numbers count batches from 0 per publisher lifetime. A live sequence that goes back
means the publisher restarted. A restart can also hide inside a gap or a disconnect (the new
lifetime may already be past the old one's last sequence), so a replay after a gap or a
reconnect starts at the last sequence applied and compares the batch there with the digest of
the one applied: a different batch, none while later ones come, or an empty buffer means a new
lifetime. Either way the stream's ranks are cleared from the mirror and rebuilt from the new
lifetime's replay. A monitor on the SUB socket says when the connection drops: from then until
a replay answers, health says batches may have been missed.
Nothing here blocks for longer than the timeouts given; bad frames are counted and noted.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import time
import weakref

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvscope.sessions.kv_events.mirror import Mirror
from kvscope.sessions.kv_events.wire import END_SEQ, WireError, decode_batch

MAX_REPLAY_BATCHES = 1_000_000  # a bound on one replay reply (vLLM keeps 10,000 batches)
MAX_DRAIN = 10_000  # live messages handled per poll before returning to the caller
SCHEMES = ("tcp://", "ipc://", "inproc://")
# After a reconnect, the replay endpoint is asked once the subscription has surely reached the
# publisher (what it publishes before that is lost live and must be in the reply): at the first
# live message, or SETTLE_S after the handshake when none comes.
SETTLE_S = 0.2
RESYNC_RETRY_S = 5.0  # a replay that did not answer after a reconnect is asked again this late
DONE, SILENT, NEW_LIFETIME = "done", "silent", "new lifetime"  # how a replay request ended
_monitors = itertools.count()  # names the monitor endpoints
WATCHED = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | \
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


def digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


class Attachment:
    def __init__(self, endpoint: str, replay: str | None = None, topic: str = "",
                 mirror: Mirror | None = None, replay_timeout_s: float = 1.0,
                 context: zmq.Context | None = None, rank: int | None = None, lock=None):
        """rank: apply every batch under this rank, whatever rank it names (a fleet's
        instance: its own health, `Mirror.healths[rank]`, and its own blocks); lock: held
        while the mirror changes (a mirror that other threads apply to and read)."""
        for name, value in (("endpoint", endpoint), ("replay endpoint", replay)):
            if value is not None and not value.startswith(SCHEMES):
                raise ValueError(f"{name} {value!r} is not a ZMQ address "
                                 "(tcp://HOST:PORT, ipc://PATH)")
        self.endpoint, self.replay, self.topic = endpoint, replay, topic
        self.mirror = mirror or Mirror()
        self.rank = rank
        self.lock = lock or contextlib.nullcontext()
        self.health = self.mirror.health if rank is None else self.mirror.health_of(rank)
        self.replay_timeout_s = replay_timeout_s
        self.ctx = context or zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 0)  # never drop on our side: gaps are the server's
        # The monitor before connecting (every event), its queue unbounded: libzmq's I/O thread
        # blocks on a full monitor queue, and every socket of the context with it (an attachment
        # nobody polled, its endpoint flapping, stalled the process's other attachments).
        address = f"inproc://kvscope-monitor-{next(_monitors)}"
        self.sub.monitor(address, WATCHED)
        self.monitor = self.ctx.socket(zmq.PAIR)
        self.monitor.setsockopt(zmq.LINGER, 0)
        self.monitor.setsockopt(zmq.RCVHWM, 0)  # before connect: inproc fixes the queue's bound
        self.monitor.connect(address)
        # Closed in this order also when nobody calls close(): a monitor closed while its SUB
        # still reports to it blocks the context's I/O thread at the SUB's next event, and every
        # socket of the context with it (a dropped attachment, its sockets finalised monitor
        # first, kept the suite's later attachments from joining).
        self._closer = weakref.finalize(self, _close_sockets, self.sub, self.monitor)
        try:
            self.sub.connect(endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise ValueError(f"cannot connect to {endpoint}: {e}") from None
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sockets = (self.sub, self.monitor)  # what a caller's poller waits on
        self._poller = zmq.Poller()
        for sock in self.sockets:
            self._poller.register(sock, zmq.POLLIN)
        self.last = -1  # highest sequence applied to the mirror
        self.last_digest: bytes | None = None  # of the payload applied at `last`
        self.live_last = -1  # highest sequence seen on the live socket
        self.ranks: set[int] = set()  # data-parallel ranks this stream published
        self.num_messages = 0  # live messages received, good or bad
        self.connected = False  # the ZMQ handshake with the publisher is done
        self.reconnected = False  # connected again since the last disconnect
        self._resync_at: float | None = None  # when to ask the replay endpoint (again)
        self._settling = False  # reconnected, the replay endpoint not asked yet
        self._said_handshake = False

    # ------------------------------------------------------------------ driving
    def start(self) -> Attachment:
        """Ask the replay endpoint for its history (up to its buffer) before going live."""
        if self.replay:
            self._replay_from(0)
        return self

    def poll(self, timeout_ms: int = 0) -> int:
        """Handle the connection events and live messages that arrive within timeout_ms (at
        most MAX_DRAIN messages); returns the number of live messages handled."""
        if self._resync_at is not None and time.monotonic() >= self._resync_at:
            self._resync()
        if not self._poller.poll(timeout_ms):
            return 0
        return self._watch() + self._drain()

    @property
    def unsure(self) -> bool:
        """Disconnected since the last replay answered: batches may have been missed."""
        return self.endpoint in self.health.unsure

    def close(self) -> None:
        self._closer()

    def _drain(self) -> int:
        n = 0
        while n < MAX_DRAIN:
            try:
                frames = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._on_live(frames)
            n += 1
        return n

    # ------------------------------------------------------------------ the connection
    def _watch(self) -> int:
        """Connection events, in order. At a disconnect, what arrived before it is applied first
        (the queue holds the old connection's messages); at a handshake after one, the replay
        endpoint is asked what was missed. Returns the live messages handled."""
        n = 0
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return n
            if event == zmq.EVENT_DISCONNECTED:
                n += self._drain()
                self.health.disconnects += 1
                self.health.unsure.add(self.endpoint)
                self.connected = self.reconnected = self._settling = False
                self._resync_at = None
                self.health.note(f"disconnected from {self.endpoint} after sequence "
                                 f"{self.last}: may have missed batches until it reconnects "
                                 "and replay answers")
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
                if self.unsure:
                    self.reconnected, self._settling = True, bool(self.replay)
                    self._resync_at = time.monotonic() + SETTLE_S if self.replay else None
            elif not self._said_handshake:
                self._said_handshake = True
                self.health.note(f"{self.endpoint} did not complete the ZMQ handshake "
                                 "(is it a ZMQ PUB socket?)")

    def _resync(self) -> None:
        """After a reconnect: what was published while disconnected, from the replay endpoint,
        checked against the last batch applied (a restart may hide in the disconnect)."""
        self._resync_at, self._settling = None, False
        if self.last < 0:
            outcome, got = self._replay_from(0)  # nothing applied yet: history
        else:
            start = self.last + 1
            outcome, got = self._replay_from(self.last, check=True)
            if outcome == NEW_LIFETIME:
                self._new_lifetime(f"the replay after reconnecting no longer has batch "
                                   f"{self.last} as applied")
                outcome, got = self._replay_from(0)
            elif got:
                h = self.health
                h.gaps, h.missing, h.repaired = h.gaps + 1, h.missing + got, h.repaired + 1
                h.note(f"reconnected to {self.endpoint}: batches {start}..{self.last}, "
                       "published while disconnected, recovered by replay")
        if outcome == DONE:
            self.health.unsure.discard(self.endpoint)
        else:
            self._resync_at = time.monotonic() + RESYNC_RETRY_S

    # ------------------------------------------------------------------ live stream
    def _on_live(self, frames: list[bytes]) -> None:
        self.num_messages += 1
        if len(frames) != 3 or len(frames[1]) != 8:
            self._bad(f"a {len(frames)}-frame message: not a vLLM/SGLang KV-event stream "
                      "(expected topic, 8-byte sequence, payload)")
            return
        if self._settling:
            self._resync()  # first, so that a restart hidden in the disconnect is seen
        seq = int.from_bytes(frames[1], "big")
        if seq <= self.live_last:
            self._new_lifetime(f"sequence {self.live_last} -> {seq}")
        self.live_last = seq
        if self.unsure and self.reconnected and not self.replay:
            self.health.unsure.discard(self.endpoint)  # the sequence tells: a gap, or none
        if seq <= self.last:
            return  # already applied through replay
        if seq > self.last + 1:
            self._fill(seq)
            self.live_last = seq  # also when the fill found a new lifetime
            if seq <= self.last:  # the replay reply reached it
                return
        self._apply(seq, frames[2])

    def _new_lifetime(self, why: str) -> None:
        """The publisher restarted: its blocks leave the mirror; sequences start again."""
        self.health.restarts += 1
        self.health.note(f"publisher restarted ({why}): its blocks were dropped from the mirror "
                         "and rebuilt from its new lifetime")
        with self.lock:
            for rank in self.ranks:
                self.mirror.clear(rank)
        self.last, self.last_digest, self.live_last = -1, None, -1

    def _fill(self, seq: int) -> None:
        """Batches last+1 .. seq-1 were not received: history (nothing applied yet) or a gap.
        A gap's replay starts at `last` to check that the publisher is the same lifetime."""
        start, h = self.last + 1, self.health
        if start == 0:
            if self.replay:
                self._replay_from(0, until=seq - 1)
            return
        outcome, got = DONE, 0
        if self.replay:
            outcome, got = self._replay_from(self.last, until=seq - 1, check=True)
            if outcome == NEW_LIFETIME:
                self._new_lifetime(f"a gap after sequence {start - 1}, whose batch the replay "
                                   "no longer has as applied")
                self._replay_from(0, until=seq - 1)
                return
            if outcome == DONE:
                h.unsure.discard(self.endpoint)
        h.gaps += 1
        h.missing += seq - start
        if got == seq - start:
            h.repaired += 1
        else:
            h.lost += seq - start - got
            h.note(f"gap: batches {start}..{seq - 1}, {got} recovered by replay"
                   + ("" if self.replay else " (no --replay endpoint)"))

    def _apply(self, seq: int, payload: bytes) -> bool:
        self.last, self.last_digest = seq, digest(payload)
        try:
            batch = decode_batch(payload)
        except WireError as e:
            self._bad(f"sequence {seq}: payload is not a KV-event batch: {e}")
            return False
        self.health.first_seq.setdefault(self.endpoint, seq)
        if self.rank is not None:
            batch.dp_rank = self.rank
        self.ranks.add(batch.dp_rank)
        with self.lock:
            self.mirror.apply(batch)
        return True

    def _bad(self, text: str) -> None:
        self.health.bad_messages += 1
        self.health.note(text)

    # ------------------------------------------------------------------ replay
    def _replay_from(self, start: int, until: int | None = None,
                     check: bool = False) -> tuple[str, int]:
        """Apply what the replay endpoint returns from `start` on (up to `until`). Returns how
        the reply ended (DONE: the end marker came; SILENT: it did not, or failed) and the
        batches applied. `check` (start == last): the reply's first batch must be the one
        applied at `start`; a different one, a later one, or none at all is NEW_LIFETIME
        (the rest of the reply is not applied)."""
        dealer = self.ctx.socket(zmq.DEALER)  # one per request: no stale replies after a timeout
        dealer.setsockopt(zmq.LINGER, 0)
        got, outcome = 0, SILENT
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
                    outcome = NEW_LIFETIME if check else DONE  # check: not even batch `start`
                    break
                seq = int.from_bytes(frames[0], "big")
                if check and seq >= start:
                    check = False
                    if seq != start or digest(frames[1]) != self.last_digest:
                        outcome = NEW_LIFETIME
                        break
                    continue
                # On a gap, batches after it are left to the live stream, which has them.
                if self.last < seq and (until is None or seq <= until) and \
                        self._apply(seq, frames[1]):
                    self.health.replayed += 1
                    got += 1
        except zmq.ZMQError as e:
            self.health.note(f"replay from {self.replay} failed: {e}")
        finally:
            dealer.close(linger=0)
        return outcome, got


def _close_sockets(sub: zmq.Socket, monitor: zmq.Socket) -> None:
    """The SUB stops reporting before its monitor's reader goes."""
    if not sub.closed:
        sub.disable_monitor()
        sub.close(linger=0)
    monitor.close(linger=0)


def listen(attachments: list[Attachment], duration_s: float) -> None:
    """Drive several attachments (one per data-parallel rank) for duration_s seconds."""
    poller = zmq.Poller()
    for a in attachments:
        for sock in a.sockets:
            poller.register(sock, zmq.POLLIN)
    deadline = time.monotonic() + duration_s
    while (left := deadline - time.monotonic()) > 0:
        poller.poll(int(min(left, 0.1) * 1000) + 1)
        for a in attachments:  # each: its messages and connection events, or a due retry
            a.poll(0)


def rank_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's rule: data-parallel rank r publishes on the endpoint's port + r."""
    head, _, port = endpoint.rpartition(":")
    if rank and not (endpoint.startswith("tcp://") and port.isdigit()):
        raise ValueError(f"cannot find data-parallel rank {rank}'s port from {endpoint} "
                         "(needs tcp://HOST:PORT)")
    return f"{head}:{int(port) + rank}" if rank else endpoint
