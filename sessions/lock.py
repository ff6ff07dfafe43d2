"""The lock a recording holds on its path: ``PATH.lock``, created exclusively, holding the pid.

A second recorder on the same path (in this process or another) is refused, overwrite or not;
the lock of a process that died is taken over. Readers use `holder` to tell a session that is
still being created from a file that is not a session.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path


class RecordingInProgressError(FileExistsError):
    """Another recording holds the path."""


def lock_path(session_path: str | os.PathLike) -> Path:
    return Path(f"{session_path}.lock")


def holder(session_path: str | os.PathLike) -> int | None:
    """The pid of the live process recording to this path (-1: one is taking the lock this
    instant), or None."""
    lock = lock_path(session_path)
    try:
        text = lock.read_text().strip()
        age = time.time() - lock.stat().st_mtime
    except (OSError, UnicodeDecodeError):
        return None
    if not text.isdigit():  # being written this instant, or garbage left by a crash
        return -1 if age < 2.0 else None
    pid = int(text)
    return pid if _alive(pid) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


class SessionLock:
    def __init__(self, path: Path, inode: int):
        self.path, self._inode = path, inode

    @classmethod
    def acquire(cls, session_path: str | os.PathLike) -> SessionLock:
        lock = lock_path(session_path)
        for _ in range(3):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                pid = holder(session_path)
                if pid is not None:
                    who = "another process" if pid < 0 else f"process {pid}"
                    raise RecordingInProgressError(
                        f"{session_path} is being recorded by {who} (lock {lock.name}): stop "
                        "that recording or choose another file") from None
                with contextlib.suppress(FileNotFoundError):
                    os.remove(lock)  # left by a recorder that died
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            return cls(lock, os.stat(lock).st_ino)
        raise RecordingInProgressError(f"{session_path}: cannot take the lock {lock.name}")

    def release(self) -> None:
        """Remove the lock file if it is still ours (never another recorder's)."""
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self._inode:
                os.remove(self.path)
