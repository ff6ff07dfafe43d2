"""Chained block hashes: stable across processes, keyed by every identity that changes the KV.

hash(block i) = sha256(hash(block i-1) || token ids of block i), where the chain starts from a root
digest of the extra keys (model fingerprint, adapter, cache salt). Because every hash folds in its
parent, the root's extra keys reach every block of the chain. sha256 rather than a fast
non-cryptographic hash because the salt is a trust boundary: a tenant must not be able to craft a
collision with another tenant's blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

BlockHash = bytes


@dataclass(frozen=True)
class ExtraKeys:
    """Everything besides the tokens that decides whether cached KV can be reused."""

    model: str = ""
    adapter: str | None = None
    cache_salt: str | None = None

    def differing(self, other: ExtraKeys) -> list[str]:
        """Names of the keys that differ, in a fixed order (for miss explanations)."""
        names = []
        if self.cache_salt != other.cache_salt:
            names.append("cache_salt")
        if self.adapter != other.adapter:
            names.append("adapter")
        if self.model != other.model:
            names.append("model")
        return names


def root_hash(keys: ExtraKeys) -> BlockHash:
    """The parent hash of a chain's first block: a canonical encoding of the extra keys."""
    parts = [
        b"kvscope-v1",
        keys.model.encode(),
        b"\x00" if keys.adapter is None else b"\x01" + keys.adapter.encode(),
        b"\x00" if keys.cache_salt is None else b"\x01" + keys.cache_salt.encode(),
    ]
    encoded = b"".join(len(p).to_bytes(4, "little") + p for p in parts)
    return hashlib.sha256(encoded).digest()


def hash_blocks(parent: BlockHash, token_ids, block_size: int,
                start_block: int = 0) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from `start_block` on; `parent` is the hash of
    block `start_block - 1` (or the root hash when start_block is 0)."""
    num_full = len(token_ids) // block_size
    if num_full <= start_block:
        return []
    # One conversion for the whole run of blocks; each block is then a slice of the byte string.
    data = array("q", token_ids[start_block * block_size : num_full * block_size]).tobytes()
    stride = block_size * 8
    hashes = []
    sha256 = hashlib.sha256
    for offset in range(0, len(data), stride):
        parent = sha256(parent + data[offset : offset + stride]).digest()
        hashes.append(parent)
    return hashes


def short_hash(block_hash: BlockHash) -> int:
    """The first 8 bytes as an unsigned int: the form shown in the GUI and stored in snapshots."""
    return int.from_bytes(block_hash[:8], "little")
