"""The session file format: tables, versions and the codecs of the BLOB columns. Torch-free.

A session is a SQLite file (extension ``.kvscope``). Tables:

- ``session``: one row of metadata (versions, model, engine config, machine, start time, whether
  the recording was closed cleanly, recorder statistics).
- ``requests``: one row per request: ids, arrival, a digest of the cache salt (never the salt),
  token counts, timings, status and finish reason. Text columns are filled only when the user
  opted in (``record_text=True``).
- ``steps``: one row per engine step: the fields of ``StepRecord``, the cache manager's running
  totals (``total_*``), the per-request computed-token counts as a delta against the previous
  step (``nct``), and the range of ``events`` rows the step published.
- ``events``: every engine event, in publication order (``id``); ``step`` is the step whose update
  carried it, ``event_step`` the step the engine stamped on it (a cancel between steps N and N+1
  is stamped N but is published with step N+1).
- ``keyframes``: the full block state every K steps (zlib-compressed numpy arrays, little-endian
  dtypes recorded in ``layout``). ``snapshot_at(step)`` decodes the nearest keyframe at or before
  the step and replays the events that follow (see replay.py).

The header carries ``application_id`` (identifies a kvscope session) and ``user_version`` (the
schema version); the ``session`` row repeats the schema version.
"""

from __future__ import annotations

import json
import zlib
from array import array
from dataclasses import fields

import numpy as np

from kvscope.engine.metrics import StepRecord
from kvscope.engine.snapshot import Snapshot

SCHEMA_VERSION = 1
APPLICATION_ID = 0x6B767363  # "kvsc"
SUFFIX = ".kvscope"

# The cache manager's running totals, stored per step (Snapshot field -> steps column).
TOTALS = {
    "hit_tokens": "total_hit_tokens",
    "query_tokens": "total_query_tokens",
    "num_requests_queried": "total_requests_queried",
    "num_requests_hit": "total_requests_hit",
    "num_evicted_blocks": "total_evicted_blocks",
    "num_cow_copies": "total_cow_copies",
}

KEYFRAME_ARRAYS = ("state", "ref_count", "owner", "block_hash", "last_use", "lru_rank")

_PY_TYPES = {"int": int, "float": float, "bool": int, "str": str}


def step_record_columns() -> dict[str, type]:
    """StepRecord fields as columns (added fields become columns of newer files)."""
    cols = {}
    for f in fields(StepRecord):
        base = str(f.type).split("|")[0].strip()
        cols[f.name] = _PY_TYPES.get(base, str)
    return cols


def create_tables(db, step_columns: dict[str, type]) -> None:
    """Create every table of an empty session database (a sqlite_utils.Database)."""
    db["session"].create({
        "id": int, "schema_version": int, "kvscope_version": str, "created_by": str,
        "model_name": str, "model_fingerprint": str, "engine_config": str, "block_size": int,
        "num_blocks": int, "machine": str, "device": str, "started_at": str,
        "started_unix": float, "monotonic_t0": float, "record_text": int, "keyframe_every": int,
        "closed_at": str, "complete": int, "num_steps": int, "num_events": int,
        "recorder_stats": str,
    }, pk="id")
    db["requests"].create({
        "request_id": int, "parent_id": int, "sample_index": int, "arrival_s": float,
        "salt_digest": str, "prompt_tokens": int, "cached_tokens": int, "output_tokens": int,
        "params": str, "status": str, "finish_reason": str, "error": str,
        "first_scheduled_s": float, "first_token_s": float, "finished_s": float,
        "queue_s": float, "ttft_s": float, "tpot_s": float, "e2e_s": float,
        "num_preemptions": int, "prompt_text": str, "output_text": str,
    }, pk="request_id")
    cols = {"step": int}
    cols.update({k: v for k, v in step_columns.items() if k != "step"})
    cols.update({c: int for c in TOTALS.values()})
    cols.update({"nct": bytes, "first_event": int, "num_events": int, "captured": int})
    db["steps"].create(cols, pk="step")
    db["events"].create({
        "id": int, "step": int, "event_step": int, "kind": str, "request_id": int,
        "blocks": bytes, "hashes": bytes, "time_ns": int, "detail": str,
    }, pk="id")
    kf = {"step": int, "num_blocks": int, "codec": str, "layout": str}
    kf.update({name: bytes for name in KEYFRAME_ARRAYS})
    kf.update({"table_ids": bytes, "table_lens": bytes, "table_blocks": bytes, "nct": bytes,
               "counters": str})
    db["keyframes"].create(kf, pk="step")


# ----------------------------------------------------------------- event blobs
def pack_i32(values) -> bytes | None:
    return array("i", values).tobytes() if values else None


def pack_u64(values) -> bytes | None:
    return array("Q", values).tobytes() if values else None


def unpack_i32(blob: bytes | None) -> tuple[int, ...]:
    return tuple(array("i", blob)) if blob else ()


def unpack_u64(blob: bytes | None) -> tuple[int, ...]:
    return tuple(array("Q", blob)) if blob else ()


# ------------------------------------------------------- computed-token deltas
def encode_nct_delta(prev: dict[int, int], cur: dict[int, int]) -> bytes:
    """[n_changed, (request, tokens) * n_changed, removed requests...] as int64."""
    out = array("q", [0])
    for r, v in cur.items():
        if prev.get(r) != v:
            out.append(r)
            out.append(v)
    out[0] = (len(out) - 1) // 2
    out.extend(r for r in prev if r not in cur)
    return out.tobytes()


def apply_nct_delta(nct: dict[int, int], blob: bytes) -> None:
    a = array("q", blob)
    n = a[0]
    for i in range(1, 1 + 2 * n, 2):
        nct[a[i]] = a[i + 1]
    for r in a[1 + 2 * n:]:
        del nct[r]


# ------------------------------------------------------------------- keyframes
def _scalar_fields() -> list[str]:
    skip = {"step", "block_size", "block_tables", "num_computed_tokens", *KEYFRAME_ARRAYS}
    return [f.name for f in fields(Snapshot) if f.name not in skip]


def encode_keyframe(snap: Snapshot, level: int = 1) -> dict:
    row = {"step": snap.step, "num_blocks": snap.num_blocks, "codec": "zlib"}
    layout = {"block_size": snap.block_size}
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
    row["nct"] = array("q", [x for kv in snap.num_computed_tokens.items() for x in kv]).tobytes()
    row["counters"] = json.dumps({k: getattr(snap, k) for k in _scalar_fields()})
    row["layout"] = json.dumps(layout)
    return row


def decode_keyframe(row: dict) -> Snapshot:
    if row["codec"] != "zlib":
        raise ValueError(f"unknown keyframe codec {row['codec']!r}")
    layout = json.loads(row["layout"])
    arrays = {}
    for name in KEYFRAME_ARRAYS:
        dtype, shape = layout[name]
        raw = bytearray(zlib.decompress(row[name]))  # writable, no extra copy
        arrays[name] = np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape) \
            .astype(np.dtype(dtype).newbyteorder("="), copy=False)
    ids = np.frombuffer(row["table_ids"], dtype="<i8")
    lens = np.frombuffer(row["table_lens"], dtype="<i8")
    blocks = np.frombuffer(zlib.decompress(row["table_blocks"]), dtype="<i4")
    ends = np.cumsum(lens)
    tables = {int(r): blocks[e - n:e].astype(np.int32) for r, n, e in zip(ids, lens, ends,
                                                                           strict=True)}
    pairs = array("q", row["nct"])
    nct = {pairs[i]: pairs[i + 1] for i in range(0, len(pairs), 2)}
    known = set(_scalar_fields())
    counters = {k: v for k, v in json.loads(row["counters"]).items() if k in known}
    return Snapshot(step=row["step"], block_size=layout["block_size"], block_tables=tables,
                    num_computed_tokens=nct, **arrays, **counters)
