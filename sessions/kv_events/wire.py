"""The KV-event wire format of vLLM (v0.9 to v0.27) and SGLang, decoded into three small types.

A live message is three ZMQ frames: topic, sequence number (8 bytes, big-endian), payload. The
payload is a msgpack batch `[ts, events, dp_rank]` or, since vLLM PR #42892, a map
`{"ts", "events", "data_parallel_rank"}` (SGLang: `attn_dp_rank`). Each event is tagged with its
class name: element 0 of an array, or the "type" key of a map. Fields this decoder does not know
are ignored; fields a version does not send take their defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

END_SEQ = b"\xff" * 8  # the replay stream's end marker (-1 as a signed 64-bit big-endian int)
STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"

# Positions in the array encoding (after the tag), in vLLM's field order (0.33's BlockStored);
# SGLang's BlockStoredWithMetadata puts a {"cache_salt"} map where vLLM has lora_name.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                  "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
                  "lookahead_token_ids")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_decode = msgspec.msgpack.Decoder().decode


class WireError(ValueError):
    """A payload that is not a KV-event batch; the message says what is wrong, in one line."""


@dataclass(slots=True)
class Stored:
    hashes: list  # int (uint64 or signed) or bytes, as published
    parent: int | bytes | None
    token_ids: list[int]
    block_size: int
    medium: str = "GPU"
    group: int = 0
    lora_name: str | None = None
    cache_salt: str | None = None  # SGLang's metadata
    spec_kind: str | None = None  # the group's kind: full_attention, sliding_window, mamba, ...
    sliding_window: int | None = None  # the group's window in tokens (sliding-window kinds)
    extra_keys: list | None = None  # per block, untagged (vLLM >= 0.17 publishes them)
    lookahead: list | None = None  # per block, the tokens after it that its hash covers (0.33)


@dataclass(slots=True)
class Removed:
    hashes: list
    medium: str = "GPU"
    group: int = 0


@dataclass(slots=True)
class Cleared:
    pass


@dataclass(slots=True)
class Batch:
    ts: float
    events: list = field(default_factory=list)
    dp_rank: int = 0


def decode_batch(payload: bytes) -> Batch:
    try:
        raw = _decode(payload)
    except (msgspec.DecodeError, ValueError, TypeError) as e:
        raise WireError(f"not msgpack: {e}") from None
    if isinstance(raw, dict):
        ts, events = raw.get("ts"), raw.get("events")
        rank = raw.get("data_parallel_rank", raw.get("attn_dp_rank"))
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise WireError(f"not an event batch (a msgpack {type(raw).__name__})")
    if not isinstance(ts, (int, float)) or not isinstance(events, list):
        raise WireError("not an event batch (no timestamp and event list)")
    if rank is not None and not isinstance(rank, int):
        raise WireError(f"data-parallel rank is not an integer: {rank!r}")
    return Batch(float(ts), [_event(e) for e in events], rank or 0)


def _fields(raw, names: tuple[str, ...]) -> dict:
    return raw if isinstance(raw, dict) else dict(zip(names, raw[1:], strict=False))


def _event(raw):
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, list) and raw:
        tag = raw[0]
    else:
        raise WireError(f"an event is a msgpack {type(raw).__name__}, not an array or map")
    if tag == STORED:
        f = _fields(raw, _STORED_FIELDS)
        hashes, parent = _hashes(f.get("block_hashes")), f.get("parent_block_hash")
        tokens, size = f.get("token_ids") or [], f.get("block_size")
        if parent is not None and not isinstance(parent, (int, bytes)):
            raise WireError(f"BlockStored parent hash is a {type(parent).__name__}")
        # block_size 0: the placeholder form of vLLM's offloading connector (no tokens either)
        if not isinstance(size, int) or size < 0 or not isinstance(tokens, list):
            raise WireError(f"BlockStored block_size is {size!r}")
        name, salt = f.get("lora_name"), None
        meta = f.get("metadata", name if isinstance(name, dict) else None)
        if isinstance(meta, dict):  # SGLang: {"cache_salt": ...}
            name, salt = None, meta.get("cache_salt")
        extra, ahead = f.get("extra_keys"), f.get("lookahead_token_ids")
        kind, window = f.get("kv_cache_spec_kind"), f.get("kv_cache_spec_sliding_window")
        return Stored(hashes, parent, tokens, size, _medium(f), _group(f),
                      name if isinstance(name, str) else None, salt,
                      kind if isinstance(kind, str) else None,
                      window if isinstance(window, int) and window > 0 else None,
                      extra if isinstance(extra, list) else None,
                      ahead if isinstance(ahead, list) else None)
    if tag == REMOVED:
        f = _fields(raw, _REMOVED_FIELDS)
        return Removed(_hashes(f.get("block_hashes")), _medium(f), _group(f))
    if tag == CLEARED:
        return Cleared()
    raise WireError(f"unknown event type {tag!r}")


def _hashes(value) -> list:
    if not isinstance(value, list) or not all(isinstance(h, (int, bytes)) for h in value):
        raise WireError("block_hashes is not a list of integers or bytes")
    return value


def _medium(f: dict) -> str:
    m = f.get("medium")
    return m if isinstance(m, str) else "GPU"  # vLLM before v0.10 and SGLang default: GPU


def _group(f: dict) -> int:
    g = f.get("group_idx")
    return g if isinstance(g, int) else 0


# ------------------------------------------------------------------------------- encoding
def encode_batch(batch: Batch, layout: str = "map") -> bytes:
    """vLLM's encoding: "map" (v0.26+) or "array" (v0.9 to v0.25, and SGLang)."""
    if layout not in ("map", "array"):
        raise ValueError(f"layout must be 'map' or 'array', not {layout!r}")
    events = [_encode_event(e, layout) for e in batch.events]
    if layout == "map":
        return msgspec.msgpack.encode(
            {"ts": batch.ts, "events": events, "data_parallel_rank": batch.dp_rank})
    return msgspec.msgpack.encode([batch.ts, events, batch.dp_rank])


def _encode_event(e, layout: str):
    if isinstance(e, Stored):
        tag, values = STORED, (e.hashes, e.parent, e.token_ids, e.block_size, None, e.medium,
                               e.lora_name, None, e.group, e.spec_kind, e.sliding_window)
        names = _STORED_FIELDS
    elif isinstance(e, Removed):
        tag, values, names = REMOVED, (e.hashes, e.medium, e.group), _REMOVED_FIELDS
    else:
        tag, values, names = CLEARED, (), ()
    if layout == "array":
        return [tag, *values]
    return {"type": tag, **dict(zip(names, values, strict=False))}
