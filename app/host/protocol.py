"""The engine process's protocol: typed commands (window -> engine) and messages (engine ->
window), pickled over the socket between `client.py` and `server.py`. Qt-free and torch-free
(both processes import it).

Each side dispatches with one table, type -> handler. What arrives is checked first (`check`):
an object that is not one of the side's types, or whose fields lack their declared types, is a
`ProtocolError` with a one-line message: the engine process answers it with an `Error`, the
window shows it in its banner. Nothing is dropped silently."""

from __future__ import annotations

from dataclasses import dataclass, fields


class ProtocolError(ValueError):
    """An unknown or malformed command or message (its text is one line)."""


class Command:
    """Window -> engine process."""


class Message:
    """Engine process -> window."""


# ------------------------------------------------------------------ commands
@dataclass(frozen=True)
class Load(Command):
    """Load a model (an EngineConfig): answered by Loaded or LoadFailed."""

    model: str
    config: object


@dataclass(frozen=True)
class Submit(Command):
    """Queue a prompt (text, token ids, or chat messages: templated in the engine process);
    answered by Submitted or Rejected. run: then run (as Resume), queued or not."""

    prompt: object
    params: object  # SamplingParams (checked by the engine: a bad one is Rejected)
    cache_salt: object = None  # str or None (checked by the engine)
    run: bool = False


@dataclass(frozen=True)
class RunWorkload(Command):
    workload: object  # a workload file's path, or a Workload


@dataclass(frozen=True)
class Resume(Command):
    """Run until there is nothing left to do (or Pause)."""


@dataclass(frozen=True)
class Pause(Command):
    """Stop running after the step under way."""


@dataclass(frozen=True)
class Pace(Command):
    """Running, at most this many steps a second (0: as fast as the engine can)."""

    steps_per_second: float


@dataclass(frozen=True)
class Step(Command):
    """One step, then paused."""


@dataclass(frozen=True)
class Cancel(Command):
    request_id: int


@dataclass(frozen=True)
class ResetPrefixCache(Command):
    """Drop every cached block's hash (engine.reset_prefix_cache)."""


@dataclass(frozen=True)
class Record(Command):
    """Record to `path` (without text: save the history kept since the model loaded)."""

    path: str
    record_text: bool


@dataclass(frozen=True)
class StopRecord(Command):
    """Stop recording: answered by Recording(None, what was written)."""


@dataclass(frozen=True)
class Watch(Command):
    """Frames carry this request's text (None: no request's)."""

    request_id: int | None


@dataclass(frozen=True)
class Ready(Command):
    """The window took the last frame: the next one may be built."""


@dataclass(frozen=True)
class Ping(Command):
    """The window's heartbeat: answered by Pong between steps."""


@dataclass(frozen=True)
class Close(Command):
    """Finish any recording and exit."""


# ------------------------------------------------------------------ messages
@dataclass(frozen=True)
class Loaded(Message):
    info: object  # EngineInfo


@dataclass(frozen=True)
class LoadFailed(Message):
    message: str
    detail: str


@dataclass(frozen=True)
class Error(Message):
    """The engine paused on an exception (or a bad command); the process serves on."""

    message: str
    detail: str


@dataclass(frozen=True)
class RequestFailed(Message):
    """One request's forward pass or sampling raised; the others run on."""

    message: str
    detail: str


@dataclass(frozen=True)
class Rejected(Message):
    """A submitted prompt that could not be queued."""

    message: str


@dataclass(frozen=True)
class Submitted(Message):
    request_id: int


@dataclass(frozen=True)
class Running(Message):
    running: bool


@dataclass(frozen=True)
class Recording(Message):
    """The recording's file (None: stopped) and a one-line status."""

    path: str | None
    note: str


@dataclass(frozen=True)
class Idle(Message):
    """Nothing left to do."""


@dataclass(frozen=True)
class NewFrame(Message):
    frame: object  # app.frames.Frame


@dataclass(frozen=True)
class Pong(Message):
    """The answer to a Ping."""


@dataclass(frozen=True)
class Exited(Message):
    """The window's own: the process's socket closed (how it ended)."""

    how: str


@dataclass(frozen=True)
class Unreadable(Message):
    """The window's own: bytes from the process that did not unpickle."""

    why: str


COMMANDS: tuple[type, ...] = (Load, Submit, RunWorkload, Resume, Pause, Pace, Step, Cancel,
                              ResetPrefixCache, Record, StopRecord, Watch, Ready, Ping, Close)
MESSAGES: tuple[type, ...] = (Loaded, LoadFailed, Error, RequestFailed, Rejected, Submitted,
                              Running, Recording, Idle, NewFrame, Pong, Exited, Unreadable)

_TYPES = {"int": int, "float": (int, float), "bool": bool, "str": str, "None": type(None),
          "object": object}


def check(obj, allowed: tuple[type, ...], what: str):
    """`obj` if it is one of `allowed` with each field of its declared type; else
    ProtocolError ("unknown engine command: ...", "malformed engine command Pace: ...")."""
    cls = type(obj)
    if cls not in allowed:
        raise ProtocolError(f"unknown {what}: {_short(obj)}")
    for f in fields(cls):
        try:
            value = getattr(obj, f.name)
        except AttributeError:
            raise ProtocolError(f"malformed {what} {cls.__name__}: no {f.name}") from None
        kinds = tuple(_TYPES[k] for k in str(f.type).split(" | "))
        flat = tuple(t for k in kinds for t in (k if isinstance(k, tuple) else (k,)))
        if not isinstance(value, flat) or (isinstance(value, bool) and bool not in flat
                                           and object not in flat):
            raise ProtocolError(f"malformed {what} {cls.__name__}: {f.name} is {_short(value)}, "
                                f"expected {f.type}")
    return obj


def _short(value) -> str:
    text = repr(value).replace("\n", " ")
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
