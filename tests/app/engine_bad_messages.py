"""Run first by the engine process in the tests that ask for it
(``MainWindow(engine_setup=<this file>)``): while the file named by $KVSCOPE_TEST_BAD_MESSAGE
exists, the engine answers a ping with what that file says instead of a Pong: "tuple" (a
message of the old string-kind protocol), "bytes" (bytes that do not unpickle) or "frame" (a
NewFrame whose frame field is missing its type: a malformed message)."""

import os
from pathlib import Path

from kvscope.app.host import protocol
from kvscope.app.host.server import EngineHost

_real_ping = EngineHost._handlers[protocol.Ping]


def _ping(self, cmd):
    flag = os.environ.get("KVSCOPE_TEST_BAD_MESSAGE")
    what = Path(flag).read_text().strip() if flag and Path(flag).exists() else ""
    if what == "tuple":
        self.conn.send(("frame", None))
    elif what == "bytes":
        self.conn.send_bytes(b"not a pickle")
    elif what == "frame":
        self.conn.send(protocol.Recording(3, "a path that is a number"))
    return _real_ping(self, cmd)


EngineHost._handlers[protocol.Ping] = _ping
