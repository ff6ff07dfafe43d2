"""Export a recorded session: Chrome Trace Event JSON (opens in ui.perfetto.dev) and CSV.

Trace layout (times in integer microseconds from the start of the recording, so that spans that
touch never overlap by a rounding error):

- process "engine": track "steps" with one span per step, and inside it a "prefill" and a
  "decode" span with the forward time of each (laid end to end from the step's start: their
  durations are measured, their offsets inside the step are not); track "cache" with instant
  events for evictions and prefix-cache resets; counter tracks "blocks" (free / active / cached)
  and "token hit rate" (cumulative, and for the step's admissions).
- process "requests": one track per request with back-to-back spans "queued", "prefill",
  "decode" (and "preempted" / "recompute" after a preemption), and instant events for cache
  hits, copy-on-write, preemptions, cancellations and rejections. Phase changes are taken from
  the events' own times; every span carries the request's prompt / cached / output tokens and
  salt digest. Forks are named "request 7 (sample 2 of 3, forked from request 5)".
- a session with more than one KV-cache group: per group, a counter track of the blocks it
  holds and keeps cached, and a track of its block events (sessions/trace_groups.py; its
  evictions move there); the requests' cache hits and copies name their group.
- a session with a host tier: a track "host transfers" with a span per step that copied blocks
  to or from the host (the step's forward spans follow it), and a counter track "host blocks"
  (sessions/trace_host.py).

The trace starts when the recording started: a request already running then is drawn in the
phase it was in from time 0; requests finished before it are left out.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable
from dataclasses import astuple, dataclass, fields
from pathlib import Path

from kvscope.engine import events as ev
from kvscope.engine.kv_groups import NULL, KVGroup
from kvscope.sessions.reader import RecordedRequest, SessionReader
from kvscope.sessions.trace_groups import FIRST_GROUP_TID, group_tracks
from kvscope.sessions.trace_host import host_tracks, transfer_us

ENGINE_PID, REQUESTS_PID = 1, 2
STEPS_TID, CACHE_TID = 1, 2


def _open(session) -> tuple[SessionReader, bool]:
    if isinstance(session, SessionReader):
        return session, False
    return SessionReader(session), True


def chrome_trace(reader: SessionReader, first: int | None = None,
                 last: int | None = None) -> dict:
    """The session as a trace; with first / last, only the steps first..last: the spans,
    counters and events of those steps, each request in the phase it was in when the range
    began, cut where it ends. Times stay those of the whole session's trace."""
    lo = reader.first_step if first is None else max(first, reader.first_step or 0)
    hi = reader.last_step if last is None else min(last, reader.last_step or 0)
    steps = reader.steps(lo, hi) if lo is not None and lo <= hi else []
    requests = reader.requests()
    events = reader.events_between(lo, hi) if steps else []
    # The trace starts when the recording did: what happened before (requests that arrived
    # earlier) is clipped to that instant; a range is clipped to its first step's start.
    t0_ns = round(reader.meta.monotonic_t0 * 1e9)
    clip_s = reader.meta.monotonic_t0
    if first is not None and steps:
        clip_s = max(clip_s, steps[0].start_s)
        end_s = steps[-1].start_s + steps[-1].wall_s
        requests = [r for r in requests if r.arrival_s <= end_s]  # none from after the range
    clip_ns = round(clip_s * 1e9)
    # the first recorded step also publishes what the engine buffered before the recording
    events = [e for e in events if e.time_ns >= clip_ns]

    def us(seconds: float) -> int:
        return (max(clip_ns, round(seconds * 1e9)) - t0_ns) // 1000

    def us_ns(time_ns: int) -> int:
        return (max(clip_ns, time_ns) - t0_ns) // 1000

    out: list[dict] = []
    meta = [(ENGINE_PID, "engine", 0), (REQUESTS_PID, "requests", 1)]
    for pid, name, order in meta:
        out.append(dict(ph="M", pid=pid, tid=0, name="process_name", args=dict(name=name)))
        out.append(dict(ph="M", pid=pid, tid=0, name="process_sort_index",
                        args=dict(sort_index=order)))
    for tid, name in ((STEPS_TID, "steps"), (CACHE_TID, "cache")):
        out.append(dict(ph="M", pid=ENGINE_PID, tid=tid, name="thread_name",
                        args=dict(name=name)))
        out.append(dict(ph="M", pid=ENGINE_PID, tid=tid, name="thread_sort_index",
                        args=dict(sort_index=tid)))

    totals = {}
    cols, rows = reader.step_table()
    if steps:
        ih, iq = cols.index("total_hit_tokens"), cols.index("total_query_tokens")
        totals = {row[0]: (row[ih], row[iq]) for row in rows}
    end_of_session = 0
    step_ends = {}
    for s in steps:
        a = us(s.start_s)
        b = step_ends[s.step] = max(a, us(s.start_s + s.wall_s))
        end_of_session = max(end_of_session, b)
        args = dict(prefill_tokens=s.prefill_tokens, decode_tokens=s.decode_tokens,
                    batch_size=s.batch_size, num_running=s.num_running,
                    num_waiting=s.num_waiting, num_preempted=s.num_preempted,
                    warmup=s.warmup)
        out.append(dict(ph="X", pid=ENGINE_PID, tid=STEPS_TID, name=f"step {s.step}", ts=a,
                        dur=b - a, cat="step", args=args))
        t = a + min(transfer_us(s), b - a)  # the forward pass after the host tier's copies
        for name, secs, tokens in (("prefill", s.prefill_s, s.prefill_tokens),
                                   ("decode", s.decode_s, s.decode_tokens)):
            if tokens:
                d = min(round(secs * 1e6), b - t)
                out.append(dict(ph="X", pid=ENGINE_PID, tid=STEPS_TID, name=name, ts=t, dur=d,
                                cat=name, args=dict(tokens=tokens, step=s.step)))
                t += d
        out.append(dict(ph="C", pid=ENGINE_PID, tid=0, name="blocks", ts=b,
                        args=dict(free=s.num_free_blocks, active=s.num_active_blocks,
                                  cached=s.num_cached_blocks)))
        hit, query = totals.get(s.step, (None, None))
        rate = dict(cumulative=hit / query if query else 0.0)
        if getattr(s, "query_tokens", 0):
            rate["step"] = s.hit_tokens / s.query_tokens
        out.append(dict(ph="C", pid=ENGINE_PID, tid=0, name="token hit rate", ts=b, args=rate))

    groups = reader.groups
    out += _request_tracks(requests, events, clip_s, us, us_ns, end_of_session, groups)
    for e in events:  # with groups, evictions are on the groups' tracks
        if e.kind == ev.RESET or (e.kind == ev.EVICTED and len(groups) == 1):
            name = (f"evicted {len(e.blocks)} block(s)" if e.kind == ev.EVICTED
                    else f"prefix cache reset ({len(e.blocks)} block(s))")
            out.append(dict(ph="i", s="t", pid=ENGINE_PID, tid=CACHE_TID, name=name,
                            ts=us_ns(e.time_ns), cat=e.kind,
                            args=dict(step=e.step, request=e.request_id,
                                      blocks=list(e.blocks))))
    m = reader.meta
    other = dict(generator="kvscope", kvscope_version=m.kvscope_version, model=m.model_name,
                 model_fingerprint=m.model_fingerprint, device=m.device,
                 started_at=m.started_at, block_size=m.block_size, num_blocks=m.num_blocks,
                 complete=m.complete)
    if len(groups) > 1:
        out += group_tracks(reader, ENGINE_PID, step_ends, events, us_ns)
        other["kv_cache_groups"] = [g.name for g in groups]
    if reader.has_host_tier:  # (an engine with a host tier has one KV-cache group)
        tid = FIRST_GROUP_TID + (len(groups) if len(groups) > 1 else 0)
        out += host_tracks(reader, ENGINE_PID, tid, steps, step_ends, us)
    if first is not None or last is not None:
        other["steps"] = [steps[0].step, steps[-1].step] if steps else []
    return dict(traceEvents=out, displayTimeUnit="ms", otherData=other)


def _phase_at_start(r: RecordedRequest, t0: float) -> str | None:
    """What a request was doing when the recording started at t0 (None: not there yet, a fork
    still to come, or finished before)."""
    def before(t: float | None) -> bool:
        return t is not None and t <= t0

    if before(r.finished_s):
        return None
    if before(r.first_token_s):
        return "decode"
    if before(r.first_scheduled_s):
        return "prefill"
    if r.parent_id is None or before(r.arrival_s):
        return "queued"
    return None


def _request_args(r: RecordedRequest | None, rid: int) -> dict:
    if r is None:
        return dict(request=rid)
    return dict(request=rid, prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
                output_tokens=r.output_tokens, salt_digest=r.salt_digest)


def _request_tracks(requests: list[RecordedRequest], events, t0: float, us, us_ns,
                    end_of_session: int, groups: tuple[KVGroup, ...]) -> list[dict]:
    out = []
    by_id = {r.request_id: r for r in requests}
    open_span: dict[int, tuple[str, int]] = {}  # request -> (phase, start)
    last_prefill: dict[int, int] = {}
    preempted: set[int] = set()
    done: set[int] = set()  # finished: later events of the step (its DECODE) change nothing
    tid: dict[int, int] = {}
    args = {r.request_id: _request_args(r, r.request_id) for r in requests}

    def track(rid: int) -> int:
        args.setdefault(rid, _request_args(None, rid))
        if rid not in tid:
            tid[rid] = len(tid) + 1
        return tid[rid]

    def close(rid: int, t: int) -> None:
        if rid in open_span:
            phase, start = open_span.pop(rid)
            out.append(dict(ph="X", pid=REQUESTS_PID, tid=track(rid), name=phase, ts=start,
                            dur=max(0, t - start), cat="request", args=args[rid]))

    def enter(rid: int, phase: str, t: int) -> None:
        if rid in open_span:
            t = max(t, open_span[rid][1])
            close(rid, t)
        open_span[rid] = (phase, t)

    def instant(rid: int, name: str, t: int, e) -> None:
        args = dict(step=e.step, detail=e.detail, blocks=list(e.blocks))
        if len(groups) > 1 and e.kind in ev.BLOCK_EVENTS:
            args["group"] = groups[e.group].name
            name += f" ({groups[e.group].name})"
        out.append(dict(ph="i", s="t", pid=REQUESTS_PID, tid=track(rid), name=name, ts=t,
                        cat=e.kind, args=args))

    for r in requests:
        phase = _phase_at_start(r, t0)
        if phase is not None:
            track(r.request_id)
            open_span[r.request_id] = (phase, us(r.arrival_s))  # clipped to the start
    for e in events:
        rid, kind = e.request_id, e.kind
        if rid is None or rid in done:
            continue
        t = us_ns(e.time_ns)
        if kind == ev.ARRIVED and rid not in open_span:
            enter(rid, "queued", t)
        elif kind == ev.ADMITTED:
            enter(rid, "recompute" if rid in preempted else "prefill", t)
        elif kind == ev.PREFILL:
            last_prefill[rid] = t
        elif kind == ev.DECODE:
            phase = open_span.get(rid, ("", 0))[0]
            if phase != "decode":
                enter(rid, "decode", last_prefill.get(rid, t))
        elif kind == ev.FORKED:
            enter(rid, "decode", t)
        elif kind == ev.CACHE_HIT:  # (a sliding window's nulls are no blocks)
            instant(rid, f"cache hit: {sum(b != NULL for b in e.blocks)} block(s)", t, e)
        elif kind == ev.COW:
            instant(rid, "copy-on-write", t, e)
        elif kind == ev.PREEMPTED:
            enter(rid, "preempted", t)
            preempted.add(rid)
            instant(rid, "preempted", t, e)
        elif kind in (ev.FINISHED, ev.CANCELLED, ev.REJECTED):
            done.add(rid)
            if rid in open_span:
                close(rid, max(t, open_span[rid][1]))
            if kind != ev.FINISHED:
                instant(rid, kind, t, e)
    for rid in list(open_span):  # still running when the recording stopped
        close(rid, max(end_of_session, open_span[rid][1]))
    for rid, t in sorted(tid.items(), key=lambda kv: kv[1]):
        r = by_id.get(rid)
        name = f"request {rid}"
        if r is not None and r.parent_id is not None:
            n = r.params.get("n", "?")
            name += f" (sample {r.sample_index + 1} of {n}, forked from request {r.parent_id})"
        out.append(dict(ph="M", pid=REQUESTS_PID, tid=t, name="thread_name",
                        args=dict(name=name)))
        out.append(dict(ph="M", pid=REQUESTS_PID, tid=t, name="thread_sort_index",
                        args=dict(sort_index=t)))
    return out


SIDECARS = ("", "-wal", "-shm", "-journal")


def check_output(session_path: str | os.PathLike, out_path: str | os.PathLike) -> None:
    """Raise ValueError if writing `out_path` would overwrite the session or one of its SQLite
    sidecars (the same file by any name: symlinks and hard links are compared by inode)."""
    out = Path(out_path)
    try:
        out_stat = out.stat()
    except OSError:
        out_stat = None
    for suffix in SIDECARS:
        src = Path(f"{session_path}{suffix}")
        try:
            st = src.stat()
        except OSError:
            st = None
        same = (st is not None and out_stat is not None
                and (st.st_dev, st.st_ino) == (out_stat.st_dev, out_stat.st_ino))
        if same or out.resolve() == src.resolve():
            raise ValueError(f"{out} is the session file {src}: refusing to overwrite the input "
                             "(choose another output path)")


def export_chrome_trace(session, out_path: str | os.PathLike) -> Path:
    """`kvscope export SESSION --chrome-trace OUT.json`."""
    return export_session(session, CHROME_TRACE, out_path)[0]


def export_csv(session, out_dir: str | os.PathLike) -> list[Path]:
    """`kvscope export SESSION --csv DIR`: DIR/requests.csv and DIR/steps.csv."""
    return export_session(session, CSV, out_dir)


def _trace_whole(reader: SessionReader, out: Path) -> list[Path]:
    _write_trace(out, chrome_trace(reader))
    return [out]


def _write_trace(path: Path, trace: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace, f, separators=(",", ":"))


def _csv_whole(reader: SessionReader, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    req_path = out / "requests.csv"
    names = [f.name for f in fields(RecordedRequest)]
    rows = []
    for r in reader.requests():
        row = list(astuple(r))
        row[names.index("params")] = json.dumps(r.params)
        rows.append(row)
    _write_steps(req_path, names, rows)
    steps_path = out / "steps.csv"
    _write_steps(steps_path, *reader.step_table())
    return [req_path, steps_path]


def _csv_range(reader: SessionReader, out: Path, lo: int, hi: int) -> None:
    cols, rows = reader.step_table()
    i = cols.index("step")
    _write_steps(out, cols, [r for r in rows if lo <= r[i] <= hi])


@dataclass(frozen=True)
class Exporter:
    """One way out of a session: the CLI flag `--{name}` and the window's Export dialog (its
    filter is `title` and the suffix, or "a folder") come from this row; with `range_suffix`,
    the timeline's "Export this range…" offers it too (filter `range_title`), one file."""

    name: str  # the CLI flag without "--"
    metavar: str  # the CLI's placeholder for the output
    title: str  # what the Export dialog's filter says
    suffix: str  # the whole session's output: a file with this suffix ("" : a folder)
    write: Callable[[SessionReader, Path], list[Path]]  # the whole session; the paths written
    files: tuple[str, ...] = ()  # a folder's files (checked before anything is written)
    note: str = ""  # said after writing (the CLI prints it after the path)
    range_title: str = ""  # the range export's filter ("" : not offered there)
    range_suffix: str = ""
    write_range: Callable[[SessionReader, Path, int, int], None] | None = None

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def dialog_filter(self) -> str:
        return f"{self.title} (*{self.suffix})" if self.suffix else f"{self.title} (a folder)"

    @property
    def range_filter(self) -> str:
        return f"{self.range_title} (*{self.range_suffix})"

    def outputs(self, out: str | os.PathLike) -> list[Path]:
        """Every path writing to `out` touches (to check them all before writing any)."""
        return [Path(out), *(Path(out) / name for name in self.files)]


CHROME_TRACE = Exporter(
    "chrome-trace", "OUT.json", "Chrome trace for ui.perfetto.dev", ".json", _trace_whole,
    note="(open it in https://ui.perfetto.dev)", range_title="Chrome trace for ui.perfetto.dev",
    range_suffix=".json",
    write_range=lambda reader, out, lo, hi: _write_trace(out, chrome_trace(reader, lo, hi)))
CSV = Exporter("csv", "DIR", "CSV files", "", _csv_whole, files=("requests.csv", "steps.csv"),
               range_title="One row per step", range_suffix=".csv", write_range=_csv_range)
EXPORTERS: list[Exporter] = [CHROME_TRACE, CSV]


def range_exporters() -> list[Exporter]:
    """The rows the range export offers (the first is what an unknown suffix gets)."""
    return [x for x in EXPORTERS if x.write_range is not None]


def export_session(session, exporter: Exporter, out: str | os.PathLike) -> list[Path]:
    """The whole session through one exporter: every output path is checked first (never over
    the session); returns the paths written."""
    reader, owned = _open(session)
    try:
        for path in exporter.outputs(out):
            check_output(reader.path, path)
        return exporter.write(reader, Path(out))
    finally:
        if owned:
            reader.close()


def _write_steps(path: Path, cols: list[str], rows) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(cols)
        w.writerows(rows)


def export_range(session, out_path: str | os.PathLike, first: int, last: int,
                 overwrite: bool = False) -> tuple[int, int]:
    """Steps first..last of a session to one file, by the range exporter of its suffix (a
    Chrome trace for .json and any other suffix, the steps' rows for .csv). Never over the
    session; over an existing file only when `overwrite` (FileExistsError otherwise). Returns
    the steps written: the range as far as the session has it (a live history may not have
    written the newest steps yet); ValueError when it has none of them."""
    reader, owned = _open(session)
    out = Path(out_path)
    part = out.with_name(out.name + ".part")
    started = False
    try:
        check_output(reader.path, out)
        check_output(reader.path, part)
        if out.exists() and not overwrite:
            raise FileExistsError(f"{out} exists: not overwriting it")
        lo, hi = max(first, reader.first_step or 0), min(last, reader.last_step or -1)
        if reader.num_steps == 0 or lo > hi:
            raise ValueError(f"the session has none of the steps {first}–{last}")
        started = True
        exporter_for_suffix(out.suffix).write_range(reader, part, lo, hi)
        os.replace(part, out)  # a failed export leaves no half-written file behind
    finally:
        if started:
            part.unlink(missing_ok=True)
        if owned:
            reader.close()
    return lo, hi


def exporter_for_suffix(suffix: str) -> Exporter:
    """The range exporter that writes files with `suffix` (the first one for any other)."""
    rows = range_exporters()
    return next((x for x in rows if x.range_suffix == suffix.lower()), rows[0])
