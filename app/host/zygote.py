"""A warm parent for engine processes: one process per window that has imported torch and the
engine once, and forks each engine process from there (as Android's zygote does), so loading a
model after the first no longer pays for Python and torch's start-up (about 2 s of CPU each).

The window's side (`Zygote.fork`) sends the engine's socket, a pipe for its exit status, the
environment, the working folder and the setup file; the zygote forks, and the child serves the
window exactly as a freshly started `server.main` does. The zygote reaps its children and
writes each exit status (as `subprocess.Popen.returncode` reads) to its pipe. When the window's
process goes, the zygote's socket closes and it exits; its children finish on their own.
Qt-free, and it imports neither torch nor the engine on the window's side."""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import Connection

from kvscope.app.host import server

PRELOAD = ("torch", "transformers", "kvscope.engine.engine", "kvscope.engine.models.load",
           "kvscope.app.host.server")
PID_TIMEOUT_S = 60.0  # reading a forked process's pid waits at most this long for the zygote


_zygote: Zygote | None = None  # this process's, started on first use (again if it went)


def start(setup: str | os.PathLike | None = None):
    """Start an engine process, as `server.start` does, forked from this process's zygote
    on Linux: return it (`subprocess.Popen`'s poll, wait, kill, pid) and the window's end of its
    socket."""
    global _zygote
    if not sys.platform.startswith("linux"):
        return server.start(setup)
    ours, theirs = socket.socketpair()
    with theirs:
        for _attempt in range(2):
            if _zygote is None or _zygote.proc.poll() is not None:
                _zygote = Zygote()
            try:
                proc = _zygote.fork(theirs.fileno(), os.fspath(setup) if setup else None)
                return proc, Connection(ours.detach())
            except OSError:
                _zygote = None
    ours.close()
    return server.start(setup)


class ForkedProcess:
    """An engine process forked by the zygote, with `subprocess.Popen`'s poll/wait/kill. Its
    pid arrives from the zygote a moment after the fork was asked for (at the first fork, once
    the zygote has imported torch): nothing here waits for it but reading `pid` itself."""

    def __init__(self, status_fd: int):
        self.args = ["kvscope engine process"]
        self.returncode: int | None = None
        self._status = status_fd
        self._pid: int | None = None
        self._known = threading.Event()
        self._lock = threading.Lock()
        self._kill = False  # asked before the pid was known: killed as it arrives
        self._orphan = False  # the zygote went before this child

    @property
    def pid(self) -> int | None:
        self._known.wait(PID_TIMEOUT_S)
        return self._pid

    def _started(self, pid: int | None) -> None:
        with self._lock:
            self._pid = pid
            self._known.set()
            if self._kill:
                self.send_signal(signal.SIGKILL)

    def poll(self) -> int | None:
        if self.returncode is None and not self._orphan and self._ready(0):
            self._read_status()
        if self.returncode is None and self._orphan and not _alive(self._pid):
            self.returncode = -signal.SIGKILL  # how it ended is not known here
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.returncode is None and not self._orphan:
            if not self._ready(timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_status()
        while self.poll() is None:  # an orphan: watched until it goes
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def __del__(self):
        with contextlib.suppress(OSError):
            os.close(self._status)

    def kill(self) -> None:
        with self._lock:
            self._kill = True
            self.send_signal(signal.SIGKILL)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None and self._pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, sig)

    def _ready(self, timeout: float | None) -> bool:
        poller = select.poll()  # not select(): a window with many files open has fds > 1023
        poller.register(self._status, select.POLLIN)
        return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000))))

    def _read_status(self) -> None:
        """Once readable (the window's reader thread and the GUI thread both wait): the status,
        or EOF. The pipe stays open until this object goes, so no waiter ever selects on a
        closed (or reused) descriptor."""
        with self._lock:
            if self.returncode is None:
                self._read_status_once()

    def _read_status_once(self) -> None:
        data = os.read(self._status, 4)
        if len(data) == 4:
            self.returncode = struct.unpack("i", data)[0]
        elif self._pid is None:
            self.returncode = -signal.SIGKILL  # the zygote went before it forked this one
        else:
            self._orphan = True  # the zygote went first: the child, if alive, is init's now


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Zygote:
    """The window's handle on its zygote process. Forks are asked for without waiting; a thread
    reads the pids back, in order."""

    def __init__(self):
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-c", "from kvscope.app.host.zygote import main; main()",
               str(theirs.fileno())]
        with theirs:
            self.proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),))
        self.sock = ours
        self._pending: deque[ForkedProcess] = deque()
        self._lock = threading.Lock()
        threading.Thread(target=self._read_pids, daemon=True, name="kvscope-zygote").start()

    def fork(self, engine_fd: int, setup: str | None) -> ForkedProcess:
        """An engine process serving the socket `engine_fd`. OSError if the zygote is gone."""
        status_r, status_w = os.pipe()
        proc = ForkedProcess(status_r)
        try:
            request = pickle.dumps((dict(os.environ), os.getcwd(), setup))
            with self._lock:
                socket.send_fds(self.sock, [request], [engine_fd, status_w])
                self._pending.append(proc)
        except OSError:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        return proc

    def _read_pids(self) -> None:
        while True:
            try:
                reply = self.sock.recv(4, socket.MSG_WAITALL)
            except OSError:
                reply = b""
            with self._lock:
                if len(reply) != 4:  # the zygote has gone: none of the rest will start
                    for proc in self._pending:
                        proc._started(None)
                    self._pending.clear()
                    return
                self._pending.popleft()._started(struct.unpack("i", reply)[0])


def main(argv: list[str] | None = None) -> None:
    """`python -c "from kvscope.app.host.zygote import main; main()" FD`."""
    (fd,) = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the window's to handle
    for name in PRELOAD:
        __import__(name)
    sock = socket.socket(fileno=int(fd))
    statuses: dict[int, int] = {}  # child pid -> the write end of its status pipe

    def reap(_signum=None, _frame=None) -> None:
        while statuses:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            w = statuses.pop(pid, None)
            if w is not None:
                with contextlib.suppress(OSError):  # the window may no longer wait for it
                    os.write(w, struct.pack("i", os.waitstatus_to_exitcode(status)))
                os.close(w)

    signal.signal(signal.SIGCHLD, reap)
    while True:
        try:
            request, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, 2)
        except OSError:
            break
        if not request:
            break  # the window's process has gone
        engine_fd, status_w = fds
        env, cwd, setup = pickle.loads(request)
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])  # reap only once it is known
        if _fork_safe():
            pid = os.fork()
            if pid == 0:
                _child(sock, engine_fd, status_w, statuses, env, cwd, setup)
        else:  # started afresh, as server.start does without a zygote
            pid = subprocess.Popen(server.command(engine_fd, setup), pass_fds=(engine_fd,),
                                   env=env, cwd=cwd).pid
        os.close(engine_fd)
        statuses[pid] = status_w
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
        sock.sendall(struct.pack("i", pid))
        reap()
    os._exit(0)


def _fork_safe() -> bool:
    """A child forked after CUDA was initialised here could not use it: none of PRELOAD does
    that today; should one ever, children are started afresh instead."""
    import torch

    return not torch.cuda.is_initialized()


def _child(sock, engine_fd, status_w, statuses, env, cwd, setup) -> None:
    """In the forked engine process: become what `server.start` starts, then serve."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
        sock.close()
        os.close(status_w)
        for w in statuses.values():
            os.close(w)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        server.main([str(engine_fd)] + ([setup] if setup else []))  # exits when served
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - shown as a fresh process would show it
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
