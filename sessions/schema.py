"""The session file format: tables, versions and the codecs of the BLOB columns. Torch-free.

A session is a SQLite file (extension ``.kvscope``). Tables:

- ``session``: one row of metadata (versions, model, engine config, machine, start time, whether
  the recording was closed cleanly, recorder statistics, ``block_hashes``: "keyed" or "raw",
  see Recorder.stored_hash; ``kv_bytes_per_token``, the KV cache's, since host tiers: a step's
  transfers in bytes).
- ``requests``: one row per request: ids, arrival, a digest of the cache salt (never the salt),
  token counts, timings, status and finish reason. Text columns are filled only when the user
  opted in (``record_text=True``).
- ``steps``: one row per engine step: the fields of ``StepRecord``, the cache manager's running
  totals (``total_*``), the computed-token count of each live request (``nct``), and how many
  events the step published.
- ``events``: one row per step holding every event that step published, in order, as packed
  columns: ``kinds`` newline-separated, ``details`` joined by U+001F (or a JSON list), the rest
  little-endian arrays (a request id of -1 means none; ``blocks`` and ``hashes`` concatenate
  each event's, with per-event counts; see pack_events for the compact common cases). Packing
  costs the writer thread under 1 us per event against 2+ us for a row per event, and rows are
  written with multi-row statements, a few per batch (each SQLite call hands the GIL back and
  forth with the engine thread). An event's ``event_steps`` entry is the step the engine
  stamped on it: a cancel between steps N and N+1 is stamped N but published with step N+1,
  and replays with N+1.
- ``explanations`` (since version 2): why each admitted request missed the prefix cache, as the
  engine explained it at admission (one row per admission: a preempted request is explained
  again when it is re-admitted). Version 1 files have no such table and still open.
- ``experiments`` (optional, any version): experiment results, see experiments.py.
- ``request_text`` (optional, any version; rows only with ``record_text``): where each token's
  text ends in ``prompt_text`` and ``output_text`` (uint32 little-endian character offsets, one
  per token), so a replay can shade the prompt tokens that came from the cache and mark block
  boundaries. ``prompt_text`` is then exactly the tokens' pieces joined
  (kvscope.engine.token_text).
- ``keyframes``: the full block state every K steps (zlib-compressed numpy arrays, little-endian
  dtypes recorded in ``layout``). ``snapshot_at(step)`` decodes the nearest keyframe at or before
  the step and replays the events that follow (see replay.py).

The header carries ``application_id`` (identifies a kvscope session) and ``user_version`` (the
schema version); the ``session`` row repeats the schema version.
"""

from __future__ import annotations

import json
import re
import zlib
from array import array
from dataclasses import fields
from itertools import accumulate, chain

import msgspec
import numpy as np

from kvscope.engine import events as ev
from kvscope.engine.explain import MissExplanation
from kvscope.engine.kv_groups import ONE_GROUP, KVGroup
from kvscope.engine.metrics import StepRecord
from kvscope.engine.snapshot import CacheCounters, Snapshot

SCHEMA_VERSION = 2  # 2: the explanations table
APPLICATION_ID = 0x6B767363  # "kvsc"
SUFFIX = ".kvscope"

# The cache's running totals (CacheCounters), stored per step: field -> steps column.
TOTALS = {name: "total_" + name.removeprefix("num_") for name in CacheCounters.names()}

KEYFRAME_ARRAYS = ("state", "ref_count", "owner", "block_hash", "last_use", "lru_rank",
                   "parent_hash", "hit_count", "cached_seq", "block_group")

_PY_TYPES = {"int": int, "float": float, "bool": int, "str": str}


def step_record_columns() -> dict[str, type]:
    """StepRecord fields as columns (added fields become columns of newer files)."""
    cols = {}
    for f in fields(StepRecord):
        base = str(f.type).split("|")[0].strip()
        cols[f.name] = _PY_TYPES.get(base, str)
    return cols


# StepRecord fields that hold numbers per KV-cache group: stored as text, the numbers joined by
# spaces ("12 4"), so a CSV export shows them as they are.
STEP_TUPLES = tuple(f.name for f in fields(StepRecord) if str(f.type).startswith("tuple"))


def step_row(rec: StepRecord, cols: list[str]) -> list:
    """A StepRecord's values for these steps columns."""
    return [" ".join(map(str, v)) if isinstance(v, tuple) else v
            for v in (getattr(rec, c) for c in cols)]


def decode_step_tuple(text: str | None) -> tuple[int, ...]:
    """A per-group column's value (NULL: none); ValueError if it is not whole numbers."""
    return tuple(int(x) for x in (text or "").split())


def create_tables(db, step_columns: dict[str, type]) -> None:
    """Create every table of an empty session database (a sqlite_utils.Database)."""
    db["session"].create({
        "id": int, "schema_version": int, "kvscope_version": str, "created_by": str,
        "model_name": str, "model_fingerprint": str, "engine_config": str, "block_size": int,
        "num_blocks": int, "machine": str, "device": str, "started_at": str,
        "started_unix": float, "monotonic_t0": float, "record_text": int, "keyframe_every": int,
        "closed_at": str, "complete": int, "num_steps": int, "num_events": int,
        "recorder_stats": str, "block_hashes": str,
        "kv_bytes_per_token": int,  # (a fraction kept as REAL; files from before it: none)
    }, pk="id")
    db["requests"].create({
        "request_id": int, "parent_id": int, "sample_index": int, "arrival_s": float,
        "salt_digest": str, "prompt_tokens": int, "cached_tokens": int, "output_tokens": int,
        "params": str, "status": str, "finish_reason": str, "error": str,
        "first_scheduled_s": float, "first_token_s": float, "finished_s": float,
        "queue_s": float, "ttft_s": float, "tpot_s": float, "e2e_s": float,
        "num_preemptions": int, "prompt_text": str, "output_text": str,
        "cache_breakpoint": int,  # (files from before it: none)
    }, pk="request_id")
    cols = {"step": int}
    cols.update({k: v for k, v in step_columns.items() if k != "step"})
    cols.update({c: int for c in TOTALS.values()})
    cols.update({"nct": bytes, "num_events": int, "captured": int})
    db["steps"].create(cols, pk="step")
    db["events"].create({
        "step": int, "num_events": int, "kinds": str, "event_steps": bytes,
        "request_ids": bytes, "time_ns": bytes, "num_blocks": bytes, "blocks": bytes,
        "num_hashes": bytes, "hashes": bytes, "details": str,
    }, pk="step")
    db["explanations"].create({name: EXPLANATION_COLUMNS[name] for name in EXPLANATION_COLUMNS},
                              pk=("request_id", "step"))
    # each request's prompt: the stored hashes of its full blocks, uint64 little-endian (the
    # cache lab's input); files from before it have no such table
    db["request_chains"].create({"request_id": int, "block_hashes": bytes}, pk="request_id")
    db["request_text"].create({"request_id": int, "prompt_ends": bytes, "output_ends": bytes},
                              pk="request_id")
    kf = {"step": int, "num_blocks": int, "codec": str, "layout": str}
    kf.update({name: bytes for name in KEYFRAME_ARRAYS})
    kf.update({"table_ids": bytes, "table_lens": bytes, "table_blocks": bytes, "nct": bytes,
               "counters": str, "host": bytes})  # host: the host tier's keyframe, msgpack
    db["keyframes"].create(kf, pk="step")


def encode_ends(ends) -> bytes:
    return np.asarray(ends, dtype="<u4").tobytes()


def decode_ends(blob: bytes | None) -> list[int] | None:
    return None if blob is None else np.frombuffer(blob, dtype="<u4").tolist()


# ------------------------------------------------------------------ explanations
EXPLANATION_COLUMNS = {
    "step": int, "request_id": int, "reason": str, "num_prompt_tokens": int, "block_size": int,
    "num_hit_blocks": int, "first_miss_block": int, "dropped_at_step": int, "dropped_by": str,
    "differing_keys": str,
    "window_cut": str,  # a window_cut's fields as a JSON object (files before groups: none)
}
_WINDOW_CUT = ("cut_by_group", "reach_blocks", "group_blocks_needed", "group_blocks_found",
               "full_attention")


def explanation_row(step: int, why) -> tuple:
    """A MissExplanation made at `step` as a row of the explanations table."""
    cut = json.dumps({k: getattr(why, k) for k in _WINDOW_CUT}) if why.cut_by_group else None
    return (step, why.request_id, why.reason, why.num_prompt_tokens, why.block_size,
            why.num_hit_blocks, why.first_miss_block, why.dropped_at_step, why.dropped_by,
            ",".join(why.differing_keys), cut)


def explanation_from_row(row: tuple) -> MissExplanation:
    _, rid, reason, n, bs, hit, first, dropped_at, dropped_by, keys, cut = row
    cut = json.loads(cut) if cut else {}
    return MissExplanation(rid, reason, n, bs, hit, first, dropped_at, dropped_by,
                           tuple(k for k in (keys or "").split(",") if k),
                           **{k: cut[k] for k in _WINDOW_CUT if k in cut})


# ----------------------------------------------------------------- event blobs
EVENT_COLUMNS = ("step", "num_events", "kinds", "event_steps", "request_ids", "time_ns",
                 "num_blocks", "blocks", "num_hashes", "hashes", "details")


def event_tuples(events) -> list[tuple]:
    """Events as plain tuples (kind, step, request_id, blocks, time_ns, hashes, detail): cheap
    (~0.1 us each) and, unlike Event objects, dropped by the garbage collector's tracking, so
    holding them until the writer's next batch costs no full collections. A block event of
    KV-cache group g > 0 has the kind "<kind>@g", one of an attached server's tier below its GPU
    "<kind>#<medium>" after that (see split_kind)."""
    return [(e.kind if not e.group and not e.medium else
             e.kind + (f"@{e.group}" if e.group else "") + (f"#{e.medium}" if e.medium else ""),
             e.step, e.request_id, e.blocks, e.time_ns, e.hashes, e.detail) for e in events]


def split_kind(kind: str) -> tuple[str, int]:
    """A stored kind -> (kind, KV-cache group): "allocated@1" -> ("allocated", 1) (a tier's
    medium dropped: see split_tier)."""
    kind = kind.split("#", 1)[0]
    if "@" not in kind:
        return kind, 0
    kind, group = kind.split("@", 1)
    return kind, int(group)


def split_tier(kind: str) -> tuple[str, str]:
    """A stored kind -> (the kind with its group, the tier's medium): "cached@1#CPU" ->
    ("cached@1", "CPU"); "" for the top pool's."""
    kind, _, medium = kind.partition("#")
    return kind, medium


_SEP = "\x1f"  # unit separator: joins the details when none contains it (else JSON)


def pack_events(step: int, events: list[tuple]) -> tuple:
    """One step's event tuples (see event_tuples) as a row of EVENT_COLUMNS. The common cases
    are stored compactly: ``event_steps`` empty when every event is stamped with `step`,
    ``num_hashes`` empty when no event has hashes, ``details`` joined by _SEP (else JSON)."""
    n = len(events)
    kinds, steps, rids, blocks, times, hashes, details = zip(*events, strict=True)
    if None in rids:
        rids = [-1 if r is None else r for r in rids]
    joined = _SEP.join(details)
    details = _SEP + joined if joined.count(_SEP) == n - 1 else json.dumps(details)
    flat_blocks = array("i", chain.from_iterable(blocks)).tobytes()
    flat_hashes = array("Q", chain.from_iterable(hashes)).tobytes()
    return (step, n, "\n".join(kinds),
            b"" if steps.count(step) == n else array("q", steps).tobytes(),
            array("q", rids).tobytes(), array("q", times).tobytes(),
            array("i", map(len, blocks)).tobytes(), flat_blocks,
            array("i", map(len, hashes)).tobytes() if flat_hashes else b"", flat_hashes, details)


def event_columns(row, with_details: bool = True):
    """A packed row -> (kinds, event steps, request ids, times, block counts, blocks, hash
    counts, hashes, details) as sequences of n (details None unless asked for)."""
    step, n, kinds, steps, rids, times, nb, blocks, nh, hashes, details = row
    kinds = kinds.split("\n")
    if len(kinds) != n:
        raise ValueError(f"{len(kinds)} event kinds for {n} events")
    steps = array("q", steps) if steps else [step] * n
    nh = array("i", nh) if nh else array("i", bytes(4 * n))
    if with_details:
        details = details[1:].split(_SEP) if details.startswith(_SEP) else json.loads(details)
    else:
        details = None
    return (kinds, steps, array("q", rids), array("q", times), array("i", nb), array("i", blocks),
            nh, array("Q", hashes), details)


def unpack_events(row, kinds_wanted=None) -> list[tuple]:
    """Rows of EVENT_COLUMNS -> (kind, event_step, request_id, blocks, hashes, time_ns, detail)
    tuples in order; with `kinds_wanted`, only events of those kinds."""
    kinds, steps, rids, times, nb, blocks, nh, hashes, details = event_columns(row)
    idx = range(len(kinds)) if kinds_wanted is None else \
        [i for i, k in enumerate(kinds) if k in kinds_wanted]
    b_end, h_end = list(accumulate(nb)), list(accumulate(nh))
    out = []
    for i in idx:
        be, he = b_end[i], h_end[i]
        rid = rids[i]
        out.append((kinds[i], steps[i], None if rid < 0 else rid, tuple(blocks[be - nb[i]:be]),
                    tuple(hashes[he - nh[i]:he]) if nh[i] else (), times[i], details[i]))
    return out


def _values_codec(fmt: str):
    """A detail format's inverse: a pattern and how to convert its groups ("{} cached, {} to
    compute": two ints; "{}", the whole text: a reason)."""
    if fmt == "{}":
        return re.compile(r"(?s)(.*)"), tuple
    pattern = re.compile(re.escape(fmt).replace(r"\{\}", "([0-9]+)"))
    return pattern, lambda groups: tuple(map(int, groups))


_VALUE_CODECS = {kind: _values_codec(fmt) for kind, fmt in ev.DETAIL_FORMATS.items()}


def event_values(kind: str, detail: str) -> tuple:
    """The named values (events.VALUES) of an event as a session stores them: packed in its
    detail text, which the engine writes from them (events.DETAIL_FORMATS), in files of every
    version. The one place that reads a detail back; () when it does not match (a damaged
    file: the event then has no values)."""
    codec = _VALUE_CODECS.get(kind)
    m = None if codec is None else codec[0].fullmatch(detail)
    return () if m is None else codec[1](m.groups())


def event_of(kind: str, step: int, rid: int | None, blocks: tuple, hashes: tuple, time_ns: int,
             detail: str) -> ev.Event:
    """An unpacked event tuple (see unpack_events) as the Event the engine published (ValueError:
    a kind this kvscope does not know)."""
    medium = split_tier(kind)[1]
    kind, group = split_kind(kind)
    return ev.Event(ev.EventKind(kind), step, rid, blocks, time_ns, hashes, detail,
                    event_values(kind, detail), group, medium)


# ------------------------------------------------------- computed-token deltas
def encode_nct(nct: dict[int, int]) -> bytes:
    """Computed tokens per live request: int64 request ids, then int64 counts (C-level copies;
    a full copy per step costs less than a delta and needs no previous step to decode)."""
    return array("q", nct).tobytes() + array("q", nct.values()).tobytes()


def decode_nct(blob: bytes) -> dict[int, int]:
    a = array("q", blob)
    n = len(a) // 2
    return dict(zip(a[:n], a[n:], strict=True))


# ------------------------------------------------------------------- keyframes
def _scalar_fields() -> list[str]:
    skip = {"step", "block_size", "block_tables", "num_computed_tokens", "counters",
            "groups", "more_tables", "host", *KEYFRAME_ARRAYS}
    return [f.name for f in fields(Snapshot) if f.name not in skip]


def encode_keyframe(snap: Snapshot, level: int = 1) -> dict:
    row = {"step": snap.step, "num_blocks": snap.num_blocks, "codec": "zlib"}
    layout = {"block_size": snap.block_size}
    layout["groups"] = [[g.window, list(g.layers)] + ([g.spec_kind] if g.spec_kind else [])
                        for g in snap.groups]  # an attached server's spec kind, when named
    if snap.more_tables:
        layout["more_tables"] = [{str(r): t.tolist() for r, t in g.items()}
                                 for g in snap.more_tables]
    for name in KEYFRAME_ARRAYS:
        a = np.ascontiguousarray(getattr(snap, name))
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        layout[name] = [a.dtype.str, list(a.shape)]
        row[name] = zlib.compress(a.tobytes(), level)
    ids = np.fromiter(snap.block_tables, dtype="<i8", count=len(snap.block_tables))
    tables = [np.asarray(snap.block_tables[r], dtype="<i4") for r in snap.block_tables]
    row["table_ids"] = ids.tobytes()
    row["table_lens"] = np.array([len(t) for t in tables], dtype="<i8").tobytes()
    row["table_blocks"] = zlib.compress(
        (np.concatenate(tables) if tables else np.zeros(0, "<i4")).tobytes(), level)
    row["nct"] = encode_nct(snap.num_computed_tokens)
    counters = {k: getattr(snap, k) for k in _scalar_fields()}
    counters.update(zip(CacheCounters.names(), snap.counters.as_tuple(), strict=True))
    row["counters"] = json.dumps(counters)
    row["layout"] = json.dumps(layout)
    if snap.host is not None:  # the tier below (a host tier's pool): a keyframe of its own,
        row["host"] = msgspec.msgpack.encode(encode_keyframe(snap.host, level))  # in one blob
    return row


def _inflate(blob: bytes, size: int, name: str) -> bytearray:
    """zlib-decompress `blob`, which must inflate to exactly `size` bytes (what the keyframe's
    layout implies): a damaged or hostile blob is refused after at most `size` + 1 bytes."""
    d = zlib.decompressobj()
    out = bytearray(d.decompress(blob, size + 1))  # writable, no extra copy
    if len(out) != size or not d.eof:
        raise ValueError(f"keyframe {name} does not inflate to the {size} bytes its layout "
                         "gives")
    return out


MAX_TIERS = 4  # pools in a keyframe, one below another (an attached GPU, CPU, STORAGE, ...)


def decode_keyframe(row: dict, depth: int = 1) -> Snapshot:
    if row["codec"] != "zlib":
        raise ValueError(f"unknown keyframe codec {row['codec']!r}")
    layout = json.loads(row["layout"])
    num_blocks = row["num_blocks"]
    arrays = {}
    for name in KEYFRAME_ARRAYS:
        if name not in layout:  # an array added after the file was written
            continue
        dtype, shape = layout[name]
        dtype = np.dtype(dtype)
        if list(shape) != [num_blocks]:
            raise ValueError(f"keyframe array {name} has shape {shape}, expected "
                             f"[{num_blocks}] (the keyframe's number of blocks)")
        raw = _inflate(row[name], num_blocks * dtype.itemsize, name)
        arrays[name] = np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="),
                                                              copy=False)
    ids = np.frombuffer(row["table_ids"], dtype="<i8")
    lens = np.frombuffer(row["table_lens"], dtype="<i8")
    if lens.size and (lens.min() < 0 or lens.max() > num_blocks):
        raise ValueError("keyframe block tables have impossible lengths")
    blocks = np.frombuffer(_inflate(row["table_blocks"], int(lens.sum()) * 4, "table_blocks"),
                           dtype="<i4")
    ends = np.cumsum(lens)
    tables = {int(r): blocks[e - n:e].astype(np.int32) for r, n, e in zip(ids, lens, ends,
                                                                           strict=True)}
    nct = decode_nct(row["nct"])
    stored = json.loads(row["counters"])
    scalars = {k: stored[k] for k in _scalar_fields() if k in stored}
    if "forms" in scalars:  # (JSON keeps the tuple as a list)
        if not isinstance(scalars["forms"], list) or not all(
                isinstance(f, str) for f in scalars["forms"]):
            raise ValueError("keyframe tier forms are not a list of names")
        scalars["forms"] = tuple(scalars["forms"])
    if not isinstance(scalars.get("medium", ""), str):
        raise ValueError("keyframe tier medium is not a name")
    counters = CacheCounters(**{k: stored[k] for k in CacheCounters.names() if k in stored})
    arrays.setdefault("block_group", np.zeros(num_blocks, np.uint8))  # (before groups: all 0)
    groups = tuple(KVGroup(g[0], tuple(g[1]), *g[2:3]) for g in layout.get("groups", ()))
    more = tuple({int(r): np.array(t, dtype=np.int32) for r, t in g.items()}
                 for g in layout.get("more_tables", ()))
    host = row.get("host")  # (files from before host tiers: no such column)
    if host:
        try:
            host = msgspec.msgpack.decode(host)
            if not isinstance(host, dict) or (host.get("host") and depth + 1 >= MAX_TIERS):
                raise TypeError
            host = decode_keyframe(host, depth + 1)
        except (msgspec.DecodeError, KeyError, TypeError):
            raise ValueError("keyframe host tier is not a keyframe") from None
    return Snapshot(step=row["step"], block_size=layout["block_size"], block_tables=tables,
                    num_computed_tokens=nct, counters=counters, groups=groups or ONE_GROUP,
                    more_tables=more, host=host or None, **arrays, **scalars)
