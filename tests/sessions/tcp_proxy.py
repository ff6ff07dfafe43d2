"""A TCP proxy on loopback, between a publisher and a subscriber, that can drop the connection:
`down()` cuts every connection and refuses new ones (its port stops listening) until `up()`.
One thread forwards bytes both ways; ZMQ on either side reconnects by itself."""

from __future__ import annotations

import selectors
import socket
import threading
import time


class TcpProxy:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1"):
        self.host, self.upstream = host, (host, upstream_port)
        self._listener = self._listen(0)
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"tcp://{host}:{self.port}"
        self.num_accepted = 0  # connections forwarded so far
        self._peer: dict[socket.socket, socket.socket] = {}
        self._want_up = True
        self._changed = threading.Event()  # set by the thread once a down()/up() took effect
        self._stop = threading.Event()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, daemon=True, name="tcp-proxy")
        self._thread.start()

    def _listen(self, port: int) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.host, port))
        s.listen(16)
        return s

    # ------------------------------------------------------------------ control
    def down(self) -> None:
        """Cut every connection and refuse new ones; returns once that is done."""
        self._switch(False)

    def up(self) -> None:
        """Listen again (the same port); returns once it does."""
        self._switch(True)

    def _switch(self, up: bool) -> None:
        self._want_up = up
        self._changed.clear()  # after: the thread sets it once its state is the one asked for
        if not self._changed.wait(5.0):
            raise TimeoutError("the proxy thread did not switch")

    def wait_accepted(self, n: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.num_accepted < n and time.monotonic() < deadline:
            time.sleep(0.005)
        assert self.num_accepted >= n, f"{self.num_accepted} connections, waited for {n}"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_switch()
                for key, _ in self._sel.select(0.01):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj in self._peer:
                        self._forward(key.fileobj)
        finally:
            self._cut()
            if self._listener is not None:
                self._sel.unregister(self._listener)
                self._listener.close()
            self._sel.close()

    def _apply_switch(self) -> None:
        if not self._want_up and self._listener is not None:
            self._cut()
            self._sel.unregister(self._listener)
            self._listener.close()
            self._listener = None
            self._changed.set()
        elif self._want_up and self._listener is None:
            self._listener = self._listen(self.port)
            self._sel.register(self._listener, selectors.EVENT_READ)
            self._changed.set()
        elif not self._changed.is_set():
            self._changed.set()  # already in the state asked for

    def _accept(self) -> None:
        client, _ = self._listener.accept()
        try:
            upstream = socket.create_connection(self.upstream, timeout=1.0)
        except OSError:
            client.close()  # nothing behind us: as if refused
            return
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.settimeout(5.0)
            self._sel.register(s, selectors.EVENT_READ)
        self._peer[client], self._peer[upstream] = upstream, client
        self.num_accepted += 1

    def _forward(self, s: socket.socket) -> None:
        try:
            data = s.recv(1 << 16)
            if data:
                self._peer[s].sendall(data)
                return
        except OSError:
            pass
        self._close_pair(s)  # one side closed or failed: close both, as a network drop does

    def _close_pair(self, s: socket.socket) -> None:
        other = self._peer.pop(s)
        self._peer.pop(other, None)
        for x in (s, other):
            self._sel.unregister(x)
            x.close()

    def _cut(self) -> None:
        while self._peer:
            self._close_pair(next(iter(self._peer)))
