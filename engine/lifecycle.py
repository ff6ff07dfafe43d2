"""The request lifecycle folded from the step stream: the one fold behind the engine process's
request table (app/host/server.py), the recorder's request rows (sessions/recorder.py) and a
replayed session's rows (app/sources/replay.py). Torch-free.

A request is waiting, running or finished. The step stream says so in the order a `StepUpdate`
carries it: new requests (`arrive`), then the step's events (`apply`), then the outputs
(`output`). A replay has the recorded events alone, and gets the same states from them."""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.engine import events as ev

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"

# The events that move a request, and where they lead. PREFILL: a prompt chunk is computed (the
# request has not sampled since).
TRANSITIONS = {ev.ARRIVED: WAITING, ev.PREEMPTED: WAITING, ev.ADMITTED: RUNNING,
               ev.FORKED: RUNNING, ev.PREFILL: RUNNING, ev.FINISHED: FINISHED,
               ev.CANCELLED: FINISHED, ev.REJECTED: FINISHED}
# The kinds a replay reads to fold its requests (PREFILL changes no state there: it only
# follows an admission).
LIFECYCLE_KINDS = frozenset(k for k in TRANSITIONS if k != ev.PREFILL)


@dataclass(slots=True)
class Lifecycle:
    """One request's state in its lifecycle."""

    request_id: int
    status: str = WAITING  # WAITING | RUNNING | FINISHED
    admitted: bool = False  # looked up in the cache at least once (ADMITTED seen)
    cached_tokens: int = 0  # found in the cache at its first admission
    just_arrived: bool = True  # nothing has happened to it since it arrived
    sampled: bool = False  # running, and it has sampled since it last computed a prompt chunk
    reason: str | None = None  # why it finished: the finish reason, "cancelled", "rejected"
    reported: bool = False  # its final output was seen (the output's finish reason holds)

    @property
    def finished(self) -> bool:
        return self.status == FINISHED


class Lifecycles:
    """Each request's Lifecycle, by request id, folded from the stream (or a recorded one)."""

    def __init__(self):
        self.requests: dict[int, Lifecycle] = {}

    def get(self, request_id: int) -> Lifecycle | None:
        return self.requests.get(request_id)

    def arrive(self, request_id: int, parent_id: int | None = None) -> Lifecycle:
        """A request entered the engine (a NewRequest); a forked sample starts running, in
        decode."""
        life = self.requests.get(request_id)
        if life is None:
            life = self.requests[request_id] = Lifecycle(request_id)
            if parent_id is not None:
                life.status, life.sampled, life.just_arrived = RUNNING, True, False
        return life

    def apply(self, e: ev.Event) -> Lifecycle | None:
        """One event; None if it moves no request (not a lifecycle kind, no request, or the
        request had finished). A request first seen here (a replay's) is added."""
        to = TRANSITIONS.get(e.kind)
        if to is None or e.request_id is None:
            return None
        life = self.requests.get(e.request_id)
        if life is None:
            life = self.requests[e.request_id] = Lifecycle(e.request_id)
        elif life.finished:
            return None
        life.status, life.just_arrived = to, e.kind == ev.ARRIVED
        if e.kind == ev.ADMITTED:
            if not life.admitted:
                life.admitted, life.cached_tokens = True, e.cached_tokens or 0
            life.sampled = False
        elif e.kind == ev.PREFILL:
            life.sampled = False
        elif e.kind == ev.FORKED:
            life.sampled = True
        elif to == FINISHED:
            life.reason = e.reason if e.kind == ev.FINISHED else str(e.kind)
        return life

    def output(self, o) -> tuple[Lifecycle, bool]:
        """A RequestOutput (after a step, or a submit or cancel between steps): (its
        lifecycle, whether this output finished it). A request's first final output gives the
        finish reason (a failed one's: "error", where its FINISHED event says "error: ...")."""
        life = self.arrive(o.request_id)
        if o.finished:
            if not life.reported:
                life.status, life.reason, life.reported = FINISHED, o.finish_reason, True
                return life, True
        elif o.token_ids and life.status == RUNNING:
            life.sampled = True
        return life, False

    def forget(self, request_id: int) -> None:
        self.requests.pop(request_id, None)
