"""A fleet: many servers attached at once, each an instance with a name, mirrored under a rank of
its own in one Mirror, and the fleet prefix index over them (as llm-d's kv-cache indexer: block
hash -> the instances holding it, per KV group and tier).

    instances = read_fleet("fleet.txt")      # lines: name endpoint [replay] [metrics]
    index = FleetIndex(mirror, [i.name for i in instances])
    index.holders(group=0, block_hash=h)     # {"a": {"GPU"}, "c": {"GPU", "CPU"}}
    index.prefix_held([h0, h1, h2])          # {"a": 3, "b": 1, "c": 0}: leading blocks held

The cache digest (`cache_digest`) names a set of (group, medium, hash) in one short string, so
that a server (`kvscope serve` prints its own at the end) and a mirror can be compared.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvscope.sessions.kv_events.mirror import Mirror

ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")
HTTP_SCHEMES = ("http://", "https://")
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,32}")
MAX_INSTANCES = 64


@dataclass(frozen=True)
class Instance:
    """One attached server of a fleet."""

    name: str
    endpoint: str
    replay: str | None = None
    metrics: str | None = None


def parse_instance(fields: list[str]) -> Instance:
    """`name endpoint [replay] [metrics]` (replay and metrics told apart by their scheme; "-" for
    none). Raises ValueError saying what is wrong, in a few words."""
    if len(fields) < 2:
        raise ValueError("needs a name and an endpoint: name tcp://HOST:PORT [replay] [metrics]")
    if len(fields) > 4:
        raise ValueError(f"{len(fields)} fields; at most 4: name endpoint [replay] [metrics]")
    name, endpoint, *rest = fields
    if not _NAME.fullmatch(name):
        raise ValueError(f"name {name!r}: use 1-32 letters, digits, '_', '.', ':' or '-'")
    if not endpoint.startswith(ZMQ_SCHEMES):
        raise ValueError(f"endpoint {endpoint!r} is not a ZMQ address (tcp://HOST:PORT, ipc://PATH)")
    replay = metrics = None
    for value in rest:
        if value == "-":
            continue
        if value.startswith(ZMQ_SCHEMES) and replay is None and metrics is None:
            replay = value
        elif value.startswith(HTTP_SCHEMES) and metrics is None:
            metrics = value
        else:
            raise ValueError(f"{value!r} is neither a replay endpoint (tcp://, ipc://) nor a "
                             "metrics URL (http://), in that order")
    return Instance(name, endpoint, replay, metrics)


def parse_endpoint_option(text: str) -> Instance:
    """--endpoint NAME=ENDPOINT[,REPLAY][,METRICS]."""
    name, eq, rest = text.partition("=")
    if not eq:
        raise ValueError(f"--endpoint {text!r}: expected NAME=ENDPOINT[,REPLAY][,METRICS]")
    try:
        return parse_instance([name, *rest.split(",")])
    except ValueError as e:
        raise ValueError(f"--endpoint {text!r}: {e}") from None


def read_fleet(path: str | Path) -> list[Instance]:
    """A fleet file: one `name endpoint [replay] [metrics]` per line; blank lines and `#` comments
    skipped. Raises ValueError naming the file and line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--fleet {path}: cannot read it: {e}") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        try:
            out.append(parse_instance(fields))
        except ValueError as e:
            raise ValueError(f"--fleet {path} line {n}: {e}") from None
    if not out:
        raise ValueError(f"--fleet {path}: no instances (lines: name endpoint [replay] [metrics])")
    return out


def check_fleet(instances: list[Instance]) -> None:
    """Names and endpoints must each be distinct; raises ValueError otherwise."""
    if len(instances) > MAX_INSTANCES:
        raise ValueError(f"{len(instances)} instances: at most {MAX_INSTANCES}")
    for what in ("name", "endpoint"):
        seen: set[str] = set()
        for i in instances:
            value = getattr(i, what)
            if value in seen:
                raise ValueError(f"two instances have the {what} {value!r}")
            seen.add(value)


class FleetIndex:
    """Which instances (the mirror's ranks, by name) hold a block hash, per KV group and tier,
    read off the mirror's own keys: one dict lookup per instance and tier."""

    def __init__(self, mirror: Mirror, names: list[str]):
        self.mirror, self.names = mirror, list(names)

    def media(self) -> list[str]:
        return sorted({m for _, m in self.mirror.forms}, key=lambda m: (m != "GPU", m))

    def holders(self, group: int, block_hash, media=None) -> dict[str, set[str]]:
        """Instance name -> the tiers in which it holds the hash (instances holding none left
        out)."""
        blocks, out = self.mirror.blocks, {}
        for medium in media or self.media():
            for rank, name in enumerate(self.names):
                if (rank, group, medium, block_hash) in blocks:
                    out.setdefault(name, set()).add(medium)
        return out

    def prefix_held(self, chain: list, group: int = 0, medium: str = "GPU") -> dict[str, int]:
        """Instance name -> how many leading blocks of a chain of hashes it holds in a tier (the
        prefix a cache-aware router would score), every instance named."""
        blocks, out = self.mirror.blocks, {}
        for rank, name in enumerate(self.names):
            n = 0
            while n < len(chain) and (rank, group, medium, chain[n]) in blocks:
                n += 1
            out[name] = n
        return out

    def chain_to(self, key: tuple) -> list:
        """The hashes from the first block the mirror knows of a resident key's chain to the key
        itself, following parents within its rank, group and tier."""
        rank, group, medium, h = key
        chain, seen = [], set()
        while h is not None and h not in seen and (rank, group, medium, h) in self.mirror.blocks:
            seen.add(h)
            chain.append(h)
            h = self.mirror.blocks[(rank, group, medium, h)][1]
        return chain[::-1]


def cache_digest(keys) -> str:
    """A set of (group, medium, hash) as "N blocks, digest XXXXXXXXXXXX" (equal sets: equal
    strings)."""
    items = sorted({(int(g), str(m), h if isinstance(h, bytes) else int(h) & (1 << 64) - 1)
                    for g, m, h in keys}, key=repr)
    digest = hashlib.blake2b(repr(items).encode(), digest_size=6).hexdigest()
    return f"{len(items)} blocks, digest {digest}"


def mirror_digest(mirror: Mirror, rank: int) -> str:
    """The cache digest of one rank (a fleet's instance) of a mirror."""
    return cache_digest((g, m, h) for r, g, m, h in mirror.blocks if r == rank)


def snapshot_digest(snap, medium: str = "GPU") -> str:
    """The cache digest of an engine's snapshot: each tier's blocks holding a hash, the device
    tier as `medium` and a host tier below it as "CPU" (as the publisher names them)."""
    keys, tier, name = [], snap, medium
    while tier is not None:
        held = np.flatnonzero(tier.block_hash != 0)
        keys += [(int(tier.block_group[i]), name, int(tier.block_hash[i])) for i in held]
        tier, name = tier.host, "CPU"
    return cache_digest(keys)
