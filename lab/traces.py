"""Request traces that give, per request, the prompt's block ids instead of its tokens.

- **Mooncake** (FAST'25; JSONL: ``timestamp`` ms, ``input_length``, ``output_length``,
  ``hash_ids`` at 512 tokens per block). Its ids are prefix-chained: on both public traces every
  id always follows the same id (checked: ``Trace.num_unchained_ids`` is 0).
- **Qwen-Bailian** (alibaba-edu/qwen-bailian-usagetraces-anon; JSONL: ``chat_id``,
  ``parent_chat_id``, ``timestamp`` s, ``input_length``, ``output_length``, ``turn``,
  ``hash_ids`` at 16 tokens per block). Its README says each 16-token block is hashed on its own
  (salted SipHash, remapped to integers), i.e. the ids are *not* prefix-chained: equal ids at the
  same position do not imply equal prefixes.

kvscope does not rely on either claim: every id is interned with the node before it, so a block
is the same block only when the whole run of ids from the start agrees (what a prefix cache
needs). ``num_unchained_ids`` counts the ids seen after more than one different predecessor,
i.e. how far a trace is from being chained by itself.

At kvscope's block size (which must divide the trace's), trace block i covers kvscope blocks
i*k .. i*k+k-1 (k = trace block / block size); the last trace id may cover a partial block, as
the token run it stands for is cut at ``input_length``.

A line may carry ``cache_breakpoint`` (tokens): an API caches the prompt only up to there
(a ``cache_control`` breakpoint; kvscope.lab.billing). Without it every full block is cacheable.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvscope.engine.kv_groups import ONE_GROUP, KVGroup

FORMATS = {"mooncake": 512, "bailian": 16}  # format -> tokens per trace block
MAX_SUBBLOCKS = 1024  # kvscope blocks per trace block at most (keys are node * 1024 + j)


class TraceError(ValueError):
    """A trace file that cannot be read: the message names the file and line."""


@dataclass(frozen=True, slots=True)
class LabRequest:
    arrival_s: float
    input_length: int
    output_length: int
    nodes: tuple[int, ...]  # interned chain nodes, one per trace block of the prompt
    breakpoint: int | None = None  # cache only up to this token (lab.billing; None: all)


@dataclass
class Trace:
    name: str
    format: str
    trace_block: int  # tokens per trace block
    requests: list[LabRequest]
    num_unchained_ids: int  # ids seen after more than one different predecessor
    groups: tuple[KVGroup, ...] = ONE_GROUP  # a recorded session's KV-cache groups
    kv_bytes_per_token: float | None = None  # a recorded session's model's (None: not known)

    def check_block_size(self, block_size: int) -> None:
        if block_size <= 0 or self.trace_block % block_size or \
                self.trace_block // block_size > MAX_SUBBLOCKS:
            raise TraceError(f"block size {block_size} must divide the {self.format} trace's "
                             f"{self.trace_block}-token blocks")

    def block_keys(self, r: LabRequest, block_size: int) -> list[int]:
        """One integer key per full kvscope block of r's prompt, equal exactly when the prefix
        up to and including that block is equal."""
        k = self.trace_block // block_size
        nodes = r.nodes
        return [nodes[i // k] * MAX_SUBBLOCKS + i % k
                for i in range(r.input_length // block_size)]


def detect_format(path: Path) -> str:
    """'mooncake', 'bailian' or 'session', from the file's first bytes."""
    with open(path, "rb") as f:
        head = f.read(16)
    if head.startswith(b"SQLite format 3"):
        return "session"
    try:
        with open(path, encoding="utf-8") as f:
            first = json.loads(f.readline())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise TraceError(f"{path}: not a Mooncake or Bailian trace (JSON Lines) nor a "
                         "kvscope session") from None
    if isinstance(first, dict) and "chat_id" in first:
        return "bailian"
    if isinstance(first, dict) and "hash_ids" in first:
        return "mooncake"
    raise TraceError(f"{path}: line 1 has no 'hash_ids': not a Mooncake or Bailian trace")


def load_trace(path: str | Path, fmt: str | None = None, limit: int | None = None) -> Trace:
    """Read a Mooncake or Bailian trace (format detected when fmt is None)."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    fmt = fmt or detect_format(path)
    if fmt not in FORMATS:
        raise TraceError(f"{path}: a {fmt} is not a trace the lab reads (mooncake, bailian)")
    time_scale = 1e-3 if fmt == "mooncake" else 1.0
    node_of: dict[tuple, int] = {}  # (parent node, id) -> node; the root's parent is -1
    predecessor: dict[int, int | None] = {}
    unchained: set[int] = set()
    requests = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                ids = r["hash_ids"]
                arrival = float(r["timestamp"]) * time_scale
                n_in, n_out = int(r["input_length"]), int(r["output_length"])
                if n_in < 0 or n_out < 0 or not all(isinstance(h, int) for h in ids):
                    raise ValueError("negative length or a non-integer hash id")
                cut = r.get("cache_breakpoint")
                if cut is not None and (not isinstance(cut, int) or cut < 0):
                    raise ValueError(f"cache_breakpoint must be a whole number of tokens >= 0, "
                                     f"got {cut!r}")
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise TraceError(f"{path}:{lineno}: not a {fmt} trace line ({e})") from None
            nodes, node, prev = [], -1, None
            for h in ids:
                if predecessor.setdefault(h, prev) != prev:
                    unchained.add(h)
                node = node_of.setdefault((node, h), len(node_of))
                nodes.append(node)
                prev = h
            # Tokens beyond the ids (none in the Mooncake traces) are this request's own.
            for i in range(len(ids), -(-n_in // FORMATS[fmt])):
                node = node_of.setdefault((node, ("own", lineno, i)), len(node_of))
                nodes.append(node)
            requests.append(LabRequest(arrival, n_in, n_out, tuple(nodes), cut))
    if not requests:
        raise TraceError(f"{path}: no requests")
    return Trace(path.name, fmt, FORMATS[fmt], requests, len(unchained))
