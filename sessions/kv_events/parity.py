"""Hash parity: recompute a vLLM server's block hashes from the token ids it publishes and flag
the blocks whose published hash differs (a router or indexer computing hashes from prompts would
never match those blocks: a salt, a LoRA adapter, multimodal inputs or a setting differs).

What is recomputed exactly (vLLM v1, `vllm/v1/core/kv_cache_utils.py`):
    hash(block) = H((parent digest or NONE_HASH, tuple(token ids), extra keys or None))
    H = sha256 over pickle (protocol 5) for "sha256", over canonical CBOR for "sha256_cbor";
    NONE_HASH = H(seed), seed = PYTHONHASHSEED or, since vLLM #51875, "vllm-none-hash";
    published int hashes = the digest's low 64 bits (big-endian).
What is not, and is reported as unverifiable rather than guessed:
    - xxhash / xxhash_cbor (a per-process random seed unless PYTHONHASHSEED is shared; and the
      xxhash package is not a kvscope dependency); servers before #51875 without PYTHONHASHSEED
      (NONE_HASH was os.urandom); SGLang (its hashing scheme is not checked here);
    - a chain whose parent digest is unknown: int hashes keep 64 of 256 bits, so a parent must
      have been recomputed here first (history seen) unless hashes are published as bytes;
    - stores without token ids, or with a token count that is not block_size per block.
Extra keys are taken from the event's `extra_keys` when published (vLLM >= 0.11); without them
None is assumed, so a salted or LoRA block shows up as a mismatch, which is the point.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import Counter
from dataclasses import dataclass

from kvscope.sessions.kv_events.wire import Stored

ALGORITHMS = ("sha256", "sha256_cbor")
DEFAULT_SEED = "vllm-none-hash"
MASK64 = (1 << 64) - 1


def sha256_pickle(obj) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj) -> bytes:
    return hashlib.sha256(cbor(obj)).digest()


def cbor(obj) -> bytes:
    """Canonical CBOR (RFC 8949 core deterministic) of what vLLM hashes: None, bool, int, str,
    bytes, tuples and lists."""
    if obj is None:
        return b"\xf6"
    if obj is True or obj is False:
        return b"\xf5" if obj else b"\xf4"
    if isinstance(obj, int):
        return _head(0, obj) if obj >= 0 else _head(1, -1 - obj)
    if isinstance(obj, bytes):
        return _head(2, len(obj)) + obj
    if isinstance(obj, str):
        data = obj.encode()
        return _head(3, len(data)) + data
    if isinstance(obj, (tuple, list)):
        return _head(4, len(obj)) + b"".join(cbor(x) for x in obj)
    raise TypeError(f"cannot CBOR-encode a {type(obj).__name__}")


def _head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([major << 5 | extra]) + n.to_bytes(size, "big")
    raise ValueError("integer too large for CBOR")


_HASHERS = {"sha256": sha256_pickle, "sha256_cbor": sha256_cbor}


@dataclass(frozen=True)
class HashSettings:
    algorithm: str = "sha256"
    seed: str | None = DEFAULT_SEED  # the server's PYTHONHASHSEED; None: random (unknowable)

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"hash algorithm {self.algorithm!r}: only {', '.join(ALGORITHMS)} "
                             "can be recomputed (xxhash seeds are per process)")


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


class HashParity:
    def __init__(self, settings: HashSettings):
        self.settings = settings
        self.hasher = _HASHERS[settings.algorithm]
        self.none_hash = None if settings.seed is None else self.hasher(settings.seed)
        self.digests: dict = {}  # published hash -> the full digest recomputed here
        self.matched = self.mismatched = 0
        self.unverifiable: Counter = Counter()  # reason -> blocks
        self.examples: list[str] = []  # the first few mismatches, one line each

    def check(self, e: Stored) -> None:
        n = len(e.hashes)
        if len(e.token_ids) != n * e.block_size:
            self.unverifiable["no token ids (or not block_size per block)"] += n
            return
        parent = self._parent_digest(e.parent)
        if parent is None:
            self.unverifiable["parent digest unknown (history not seen, 64-bit hashes)"
                              if e.parent is not None else "NONE_HASH unknown (random seed)"] += n
            return
        extra = e.extra_keys if e.extra_keys is not None else [None] * n
        for i, published in enumerate(e.hashes):
            tokens = tuple(e.token_ids[i * e.block_size:(i + 1) * e.block_size])
            digest = self.hasher((parent, tokens, _tuples(extra[i]) if i < len(extra) else None))
            if isinstance(published, bytes):
                ours, theirs = digest, published
            else:  # int hashes: the low 64 bits, big-endian (signed ones compared as unsigned)
                ours, theirs = int.from_bytes(digest, "big") & MASK64, published & MASK64
            if ours == theirs:
                self.matched += 1
            else:
                self.mismatched += 1
                if len(self.examples) < 5:
                    self.examples.append(f"published {_show(published)}, recomputed "
                                         f"{_show(ours)} (block {i} of a store of {n})")
                if n - i - 1:  # the true digest is unknown: the rest of the chain cannot be
                    self.unverifiable["parent's hash differs"] += n - i - 1
                return
            self.digests[published] = digest
            parent = digest

    def _parent_digest(self, parent):
        if parent is None:
            return self.none_hash
        if isinstance(parent, bytes) and len(parent) == 32:
            return parent
        return self.digests.get(parent)

    def lines(self) -> list[str]:
        s = self.settings
        lines = [f"hash parity ({s.algorithm}, seed {'random' if s.seed is None else 'given'}): "
                 f"{self.matched} blocks match, {self.mismatched} differ"]
        lines += [f"  unverifiable: {n} blocks: {why}" for why, n in self.unverifiable.items()]
        lines += [f"  mismatch: {x}" for x in self.examples]
        return lines


def _show(h) -> str:
    return h[:8].hex() + "..." if isinstance(h, bytes) else f"{h & MASK64:016x}"
