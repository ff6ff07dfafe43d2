"""How vLLM puts extra keys into its block hashes and into its KV events, release by release.

    hash(block) = H((parent digest or NONE_HASH, tuple(token ids), extra keys or None))

A block's extra keys are, in this order: the LoRA adapter's, one per multimodal item in the
block, the cache salt (only the block that starts at token 0), the prompt embeddings' (one).
Read from the released wheels (`pip download --no-deps vllm==X`), in
vllm/v1/core/kv_cache_utils.py (`generate_block_hash_extra_keys`, `_gen_lora_extra_hash_keys`,
`_gen_mm_extra_hash_keys`, `_gen_prompt_embeds_extra_hash_keys`, `to_event_extra_keys`,
`hash_block_tokens`, `init_none_hash` / `resolve_none_hash_seed`, `get_request_block_hasher`),
vllm/v1/core/block_pool.py (`cache_full_blocks`, `_build_block_stored_event`),
vllm/distributed/kv_events.py (`BlockStored`) and the hash functions (`sha256`, `sha256_cbor`:
vllm/utils.py, vllm/utils/__init__.py from 0.10, vllm/utils/hashing.py from 0.12).

`RULES` has one row per change, each row the whole rule from its release on; the releases
between two rows were checked too (0.9.0 to 0.33.0: every minor release, and 0.18.1, 0.27.1).
What the rows mean for a consumer of the events:
- before 0.10.2 digests were ints (Python's hash() by default; sha256 as a 256-bit int, which
  the events could not carry): not recomputed here;
- before 0.17 `BlockStored` has no `extra_keys`: a salted, LoRA, multimodal or prompt-embeds
  block cannot be recomputed (the salt and the items are not in the events);
- 0.17 to 0.30 publish the extra keys exactly as hashed (untagged);
- from 0.31 the hash tags each key (`("cache_salt", s)`, `("lora", name, path)`,
  `("mm", identifier, offset)`, `("prompt_embeds", digest)`) but the events keep the untagged
  form (`to_event_extra_keys`), and LoRA's path is hashed but never published;
- before 0.29 NONE_HASH is random unless the server's PYTHONHASHSEED is set.
In the untagged form of 0.17 and 0.18 a multimodal key is a bare identifier (a string, like a
salt): a first block's last string is taken as its salt, which misreads an image-only first
block of those two releases.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FIRST_EVENTS = (0, 9, 0)  # KV events (vllm/distributed/kv_events.py) appeared in 0.9.0


@dataclass(frozen=True)
class Rule:
    since: tuple[int, int, int]
    digests: str  # "int" (not recomputable here) or "bytes" (32-byte digests)
    published: bool  # BlockStored carries extra_keys, one entry per block
    tagged: bool  # the hash tags each extra key; the events publish them untagged
    lora: str  # the LoRA key: "id" (lora_int_id), "name", "name+path"
    mm: str  # a multimodal item's key: "hash", "identifier", "identifier+offset"
    embeds: str | None  # prompt embeddings' key: None, "raw bytes", "sha256 digest"
    fixed_seed: bool  # NONE_HASH = H("vllm-none-hash") unless PYTHONHASHSEED (else random)
    lookahead: bool  # drafter lookahead tokens join the extra keys: (E, *tokens)
    change: str

    @property
    def name(self) -> str:
        return ".".join(map(str, self.since))


RULES = (
    Rule((0, 9, 0), "int", False, False, "id", "hash", None, False, False,
         "first KV events; BlockStored without extra keys; int digests (builtin hash() by "
         "default); keys [lora_int_id] + mm hashes + [cache_salt], untagged"),
    Rule((0, 10, 2), "bytes", False, False, "id", "hash", None, False, False,
         "32-byte digests (sha256 pickle, sha256_cbor); events carry their low 64 bits "
         "(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the default) or the bytes"),
    Rule((0, 11, 0), "bytes", False, False, "id", "identifier", None, False, False,
         "mm key: MultiModalFeatureSpec.identifier (a string)"),
    Rule((0, 11, 1), "bytes", False, False, "name", "identifier", "raw bytes", False, False,
         "LoRA key: lora_name (was lora_int_id); prompt embeds: the block's tensor bytes"),
    Rule((0, 14, 0), "bytes", False, False, "name", "identifier", "raw bytes", False, False,
         "BlockStored.lora_name published"),
    Rule((0, 17, 0), "bytes", True, False, "name", "identifier", "sha256 digest", False, False,
         "BlockStored.extra_keys published, as hashed; prompt embeds: sha256 of the block's "
         "tensor bytes"),
    Rule((0, 19, 0), "bytes", True, False, "name", "identifier+offset", "sha256 digest", False,
         False, "mm key: (identifier, item offset from the block's start)"),
    Rule((0, 29, 0), "bytes", True, False, "name", "identifier+offset", "sha256 digest", True,
         False, "NONE_HASH from the fixed seed vllm-none-hash unless PYTHONHASHSEED (sha256, "
         "sha256_cbor; xxhash stays random)"),
    Rule((0, 31, 0), "bytes", True, True, "name+path", "identifier+offset", "sha256 digest",
         True, False, "tagged keys: (\"lora\", name, path), (\"mm\", identifier, offset), "
         "(\"cache_salt\", salt), (\"prompt_embeds\", digest); published untagged "
         "(to_event_extra_keys: LoRA by name only)"),
    Rule((0, 33, 0), "bytes", True, True, "name+path", "identifier+offset", "sha256 digest",
         True, True, "lookahead hashing for drafters: extra keys (E, *next tokens); "
         "BlockStored.lookahead_token_ids"),
)
NEWEST = RULES[-1]

_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?(?:\.\d+)?(?:\.?(?:post|rc|dev)\d*)?"
                      r"(?:\+[\w.]+)?")


def parse_version(text: str) -> tuple[int, int, int]:
    """A vLLM version ("0.33", "0.33.0", "0.8.5.post1", "0.34.0rc1") as (major, minor, patch);
    ValueError with a one-line message for anything else or a release without KV events."""
    m = _VERSION.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"--vllm-version {text!r}: not a vLLM version (X.Y or X.Y.Z, e.g. "
                         f"{NEWEST.name})")
    version = (int(m[1]), int(m[2]), int(m[3] or 0))
    if version < FIRST_EVENTS:
        raise ValueError(f"--vllm-version {text}: vLLM publishes KV events since "
                         f"{'.'.join(map(str, FIRST_EVENTS))}")
    return version


def rule_for(version: tuple[int, int, int]) -> Rule | None:
    """The rule of a release; None for one newer than the newest minor release known here
    (its rule is found from the stream)."""
    if version[:2] > NEWEST.since[:2]:
        return None
    return [r for r in RULES if r.since <= version][-1]


def default_seed(rule: Rule | None) -> str | None:
    """The NONE_HASH seed without PYTHONHASHSEED: vllm-none-hash, None where it is random."""
    return "vllm-none-hash" if rule is None or rule.fixed_seed else None


class UnknownKeys(ValueError):
    """Extra keys that cannot be put back in their hashed form; the message is the reason."""


UNKNOWN_FORM = "extra keys in an unknown form"
LORA_PATH = ("LoRA adapter path unknown (vLLM >= 0.31 hashes it, the events carry only the "
             "name: pass --lora-path NAME=PATH)")


def untagged(entry) -> tuple | None:
    """A published entry as vLLM 0.17 to 0.30 hashed it: as it is (lists back to tuples)."""
    return None if entry is None else _tuples(entry)


def tagged(entry, lora_name: str | None, lora_paths: dict) -> tuple | None:
    """A published (untagged) entry as vLLM 0.31+ hashed it: the LoRA name first when the
    event names an adapter, (identifier, offset) pairs, a salt string, a digest's bytes."""
    if entry is None:
        return None
    items = list(entry)
    keys: list = []
    if lora_name is not None:
        if not items or items[0] != lora_name:
            raise UnknownKeys(UNKNOWN_FORM)
        if lora_name not in lora_paths:
            raise UnknownKeys(LORA_PATH)
        keys.append(("lora", lora_name, lora_paths[lora_name]))
        items = items[1:]
    for x in items:
        if isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], str) \
                and isinstance(x[1], int):
            keys.append(("mm", x[0], x[1]))
        elif isinstance(x, str):
            keys.append(("cache_salt", x))
        elif isinstance(x, bytes):
            keys.append(("prompt_embeds", x))
        else:
            raise UnknownKeys(UNKNOWN_FORM)
    return tuple(keys)


def published_salt(entry, lora_name: str | None) -> str | None:
    """The cache salt in a first block's published extra keys (the string after the LoRA name
    and the multimodal items), or None."""
    if not isinstance(entry, (list, tuple)):
        return None
    items = list(entry)
    if lora_name is not None and items and items[0] == lora_name:
        items = items[1:]
    salts = [x for x in items if isinstance(x, str)]
    return salts[-1] if salts else None


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x
