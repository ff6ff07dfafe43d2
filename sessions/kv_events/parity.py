"""Hash parity: recompute a vLLM server's block hashes from the token ids it publishes and flag
the blocks whose published hash differs (a router or indexer computing hashes from prompts would
never match those blocks: a salt, a LoRA adapter, multimodal inputs or a setting differs).

What is recomputed exactly (vLLM v1, `vllm/v1/core/kv_cache_utils.py`):
    hash(block) = H((parent digest or NONE_HASH, tuple(token ids), extra keys or None))
    H = sha256 over pickle (protocol 5) for "sha256", over canonical CBOR for "sha256_cbor";
    NONE_HASH = H(seed), seed = PYTHONHASHSEED or, since vLLM 0.29 (#51875), "vllm-none-hash";
    published int hashes = the digest's low 64 bits (big-endian).
The extra keys follow the rule of the server's release (`vllm_rules.RULES`): from the event's
`extra_keys` (published since vLLM 0.17), as they are (0.17 to 0.30) or tagged back as vLLM 0.31+
hashes them (`("cache_salt", s)`, `("lora", name, path)`, `("mm", identifier, offset)`,
`("prompt_embeds", digest)`), with 0.33's lookahead tokens appended when published. The rule is
the one of `--vllm-version`, or found from the stream: the first block with extra keys that
matches in one form fixes the form; until then a block that matches in neither is unverifiable.
What is not recomputed, and is reported as unverifiable rather than guessed:
    - xxhash / xxhash_cbor (a per-process random seed unless PYTHONHASHSEED is shared; and the
      xxhash package is not a kvscope dependency); servers before 0.29 without PYTHONHASHSEED
      (NONE_HASH was os.urandom); vLLM before 0.10.2 (int digests); SGLang (its hashing scheme
      is not checked here);
    - a chain whose parent digest is unknown: int hashes keep 64 of 256 bits, so a parent must
      have been recomputed here first (history seen) unless hashes are published as bytes; the
      children of a block that could not be verified carry its reason;
    - a LoRA block of vLLM 0.31+ without --lora-path (the path is hashed, never published);
    - stores without token ids, or with a token count that is not block_size per block.
Without published extra keys (vLLM < 0.17) None is assumed, so a salted or multimodal block shows
up as a mismatch, which is the point (a LoRA block, whose events name the adapter, is said to be
unverifiable instead).
"""

from __future__ import annotations

import hashlib
import pickle
from collections import Counter
from dataclasses import dataclass, field

from kvscope.sessions.kv_events.vllm_rules import (
    NEWEST,
    UNKNOWN_FORM,
    Rule,
    UnknownKeys,
    default_seed,
    parse_version,
    rule_for,
    tagged,
    untagged,
)
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


AUTO = object()  # HashSettings.seed: the default of the server's version (see vllm_rules)
NONE_HASH_RANDOM = "NONE_HASH unknown (random seed)"
HISTORY_NOT_SEEN = "parent digest unknown (history not seen, 64-bit hashes)"
PARENT_DIFFERS = "parent's hash differs"
INT_DIGESTS = "vLLM < 0.10.2 hashes to ints (Python's hash() by default): not recomputed"
LORA_NOT_PUBLISHED = "a LoRA block's extra keys are not published (vLLM < 0.17)"


@dataclass(frozen=True)
class HashSettings:
    algorithm: str = "sha256"
    # the server's PYTHONHASHSEED; None: random (unknowable); AUTO: what the version uses
    # without one (vllm-none-hash from 0.29 and for an unknown version, random before)
    seed: object = AUTO
    vllm_version: str | None = None  # "0.33.0"; None: the extra-key form is found from the stream
    lora_paths: dict = field(default_factory=dict)  # adapter name -> the path it was loaded from

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"hash algorithm {self.algorithm!r}: only {', '.join(ALGORITHMS)} "
                             "can be recomputed (xxhash seeds are per process)")
        rule = None if self.vllm_version is None else rule_for(parse_version(self.vllm_version))
        if self.seed is AUTO:
            object.__setattr__(self, "seed", default_seed(rule))
        for name, path in self.lora_paths.items():
            if not (isinstance(name, str) and name and isinstance(path, str) and path):
                raise ValueError(f"--lora-path {name!r}: an adapter name and a path, both "
                                 "non-empty")

    @property
    def rule(self) -> Rule | None:
        return None if self.vllm_version is None else rule_for(parse_version(self.vllm_version))


def lora_paths(values: list[str] | None) -> dict:
    """--lora-path NAME=PATH values as {name: path}; ValueError with a one-line message."""
    out: dict = {}
    for value in values or ():
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-path {value!r}: give NAME=PATH (the adapter's name as the "
                             "server serves it, and the path it was loaded from)")
        if out.get(name, path) != path:
            raise ValueError(f"--lora-path {name}: given twice with different paths")
        out[name] = path
    return out


class HashParity:
    def __init__(self, settings: HashSettings):
        self.settings = settings
        self.hasher = _HASHERS[settings.algorithm]
        self.none_hash = None if settings.seed is None else self.hasher(settings.seed)
        self.rule = settings.rule
        # the extra keys' form: True tagged (vLLM >= 0.31), False as published, None not known
        self.tagged = None if self.rule is None else self.rule.tagged
        self.digests: dict = {}  # published hash -> the full digest recomputed here
        self.failed: dict = {}  # published hash -> why its digest is not known (children too)
        self.matched = self.mismatched = 0
        self.keyed = 0  # blocks with extra keys seen
        self._unknown_why = UNKNOWN_FORM
        self.unverifiable: Counter = Counter()  # reason -> blocks
        self.examples: list[str] = []  # the first few mismatches, one line each

    def check(self, e: Stored) -> None:
        n = len(e.hashes)
        if self.rule is not None and self.rule.digests == "int":
            self._give_up(e.hashes, 0, INT_DIGESTS)
            return
        if not e.token_ids or len(e.token_ids) != n * e.block_size:  # (a placeholder: none)
            self.unverifiable["no token ids (or not block_size per block)"] += n
            return
        parent = self._parent_digest(e.parent)
        if parent is None:
            why = NONE_HASH_RANDOM if e.parent is None else \
                self.failed.get(e.parent, HISTORY_NOT_SEEN)
            self._give_up(e.hashes, 0, why)
            return
        for i, published in enumerate(e.hashes):
            tokens = tuple(e.token_ids[i * e.block_size:(i + 1) * e.block_size])
            try:
                forms = self._forms(e, i)
            except UnknownKeys as why:
                self._give_up(e.hashes, i, str(why))
                return
            digest = None
            for form, extra in forms:
                d = self.hasher((parent, tokens, extra))
                if _same(d, published):
                    digest = d
                    if self.tagged is None and form is not None:  # the first block that
                        self.tagged = form  # tells fixes the form (said by rules_line)
                    break
            if digest is None:
                if len(forms) != 1:  # the form is not known and neither form matched
                    self._give_up(e.hashes, i, self._unknown_why)
                    return
                self.mismatched += 1
                if len(self.examples) < 5:
                    ours = _low64(d) if not isinstance(published, bytes) else d
                    self.examples.append(f"published {_show(published)}, recomputed "
                                         f"{_show(ours)} (block {i} of a store of {n})")
                self.failed[published] = PARENT_DIFFERS
                self._give_up(e.hashes, i + 1, PARENT_DIFFERS)
                return
            self.matched += 1
            self.digests[published] = digest
            self.failed.pop(published, None)
            parent = digest

    def _forms(self, e: Stored, i: int) -> list[tuple]:
        """(form, extra keys as hashed) to try for block i: one where the form is known or does
        not matter, both while it is not known (form True tagged, False untagged)."""
        if e.extra_keys is None:  # vLLM < 0.17 (or not vLLM): nothing was hashed, or unknown
            if e.lora_name is not None:
                raise UnknownKeys(LORA_NOT_PUBLISHED)
            return [(None, _ahead(None, e, i))]
        entry = e.extra_keys[i] if i < len(e.extra_keys) else None
        if entry is None:
            return [(None, _ahead(None, e, i))]
        self.keyed += 1
        paths = self.settings.lora_paths
        if self.tagged is not None:
            keys = tagged(entry, e.lora_name, paths) if self.tagged else untagged(entry)
            return [(None, _ahead(keys, e, i))]
        forms = [(False, _ahead(untagged(entry), e, i))]
        self._unknown_why = UNKNOWN_FORM
        try:
            forms.append((True, _ahead(tagged(entry, e.lora_name, paths), e, i)))
        except UnknownKeys as why:
            self._unknown_why = str(why)
        return forms

    def _give_up(self, hashes: list, start: int, why: str) -> None:
        for h in hashes[start:]:
            if h not in self.digests:
                self.failed[h] = why
        if len(hashes) > start:
            self.unverifiable[why] += len(hashes) - start

    def _parent_digest(self, parent):
        if parent is None:
            return self.none_hash
        if isinstance(parent, bytes) and len(parent) == 32:
            return parent
        return self.digests.get(parent)

    def lines(self) -> list[str]:
        s = self.settings
        lines = [f"hash parity ({s.algorithm}, seed {'random' if s.seed is None else 'given'}): "
                 f"{self.matched} blocks match, {self.mismatched} differ", "  " + self.rules_line()]
        lines += [f"  unverifiable: {n} blocks: {why}" for why, n in self.unverifiable.items()]
        lines += [f"  mismatch: {x}" for x in self.examples]
        return lines

    def rules_line(self) -> str:
        """Which rule recomputed the extra keys, and how it was known."""
        v, r = self.settings.vllm_version, self.rule
        if r is not None:
            what = ("int digests, not recomputed" if r.digests == "int" else
                    "no extra keys published" if not r.published else
                    "extra keys tagged when hashed, untagged in the events" if r.tagged else
                    "extra keys hashed as published (untagged)")
            return f"rules: vLLM {v} (--vllm-version; rule of {r.name}): {what}"
        newer = (f"vLLM {v} is newer than the rules known here (up to {NEWEST.name}); "
                 if v is not None else "")
        if self.tagged is not None:
            form = ("tagged (vLLM >= 0.31)" if self.tagged else "untagged (vLLM 0.17 to 0.30)")
            return (f"rules: {newer}extra keys {form}, detected from the stream (the first "
                    "block with extra keys that matched in one form)")
        if not self.keyed:
            return f"rules: {newer}no block with extra keys seen (their form does not matter)"
        return (f"rules: {newer}the extra-key form is not known yet (no block with extra keys "
                "matched either form; give --vllm-version)")


def _ahead(keys, e: Stored, i: int):
    """vLLM 0.33's lookahead hashing: (E, *the tokens after the block) when published."""
    if e.lookahead is None or i >= len(e.lookahead):
        return keys
    return (keys, *e.lookahead[i])


def _low64(digest: bytes) -> int:
    return int.from_bytes(digest, "big") & MASK64


def _same(digest: bytes, published) -> bool:
    """int hashes: the low 64 bits, big-endian (signed ones compared as unsigned)."""
    if isinstance(published, bytes):
        return digest == published
    return _low64(digest) == published & MASK64


def _show(h) -> str:
    return h[:8].hex() + "..." if isinstance(h, bytes) else f"{h & MASK64:016x}"
