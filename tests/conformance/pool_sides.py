"""The same request sequence through vLLM's own KVCacheManager and through kvscope's, seen the
same way: hit tokens per admission, blocks removed (evicted) per operation, in order, and the
resident set, each block named by what it holds (salt, the whole token prefix up to its end), so
the two hash spaces need not agree.

Both sides are observed only through their KV events (vLLM's BlockStored / BlockRemoved; our
CACHED / EVICTED / RESET), as an external consumer would.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter

import torch
import vllm_ref as vr

from kvscope.engine import events as ev
from kvscope.engine.block_hash import ExtraKeys, hash_blocks, root_hash, short_hash
from kvscope.engine.kv_cache_manager import KVCacheManager
from kvscope.engine.kv_groups import KVGroup


def content_names(salt, tokens, block_size, start: int = 0, parent: bytes = b""):
    """The content name of each full block of `tokens` from block `start` on: (salt, a digest
    of the whole prefix up to the block's end), chained with blake2b, a hash neither side uses.
    `parent`: the digest of block start - 1."""
    names = []
    for i in range(start, len(tokens) // block_size):
        block = tokens[i * block_size:(i + 1) * block_size]
        parent = hashlib.blake2b(parent + array("q", block).tobytes(), digest_size=16).digest()
        names.append((salt or None, parent))
    return names


class _Side:
    """What both sides record: per operation, the content names of removed blocks."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.name_of: dict = {}  # the side's own hash -> content name
        self.resident: Counter = Counter()  # content name -> copies held under its hash
        self.removed: list = []  # content names, in the order they were removed
        self._names: dict = {}  # request -> content names of its full blocks so far

    def take_removed(self) -> list:
        out, self.removed = self.removed, []
        return out

    def _learn(self, rid, hashes, salt, tokens) -> None:
        """Name the request's block hashes not named yet (hashes[i]: its block i's)."""
        known = self._names.setdefault(rid, [])
        if len(known) < len(hashes):
            parent = known[-1][1] if known else b""
            known += content_names(salt, tokens, self.block_size, len(known), parent)
        for h, name in zip(hashes, known, strict=False):
            if h is not None:
                self.name_of[h] = name

    def _stored(self, h, group=0) -> None:
        self.resident[self._name_in(h, group)] += 1

    def _removed(self, h, group=0) -> None:
        name = self._name_in(h, group)
        self.resident[name] -= 1
        if not self.resident[name]:
            del self.resident[name]
        self.removed.append(name)


    def _name_in(self, h, group):
        """A block's content name; in a group other than 0, (group, name)."""
        return self.name_of[h] if not group else (group, self.name_of[h])


class VllmSide(_Side):
    """vLLM's KVCacheManager (one full-attention group), as its scheduler drives it. Its pool
    has one block more than `num_blocks`: block 0 is vLLM's null block, never handed out."""

    def __init__(self, num_blocks: int, block_size: int = 16, on_events=None,
                 lookahead: int = 0, windows: tuple = ()):
        """on_events(list of vLLM KV events): given what each call produced, before it is
        read here (a publisher, as vLLM's scheduler hands them to its EventPublisher).
        lookahead: vLLM's num_hash_lookahead_tokens (each hash also covers that many tokens
        after its block, for a drafter). windows: the model's KV-cache groups after a full
        attention one, as sliding windows (None in it: no full-attention group)."""
        super().__init__(block_size)
        self.on_events = on_events
        kw = dict(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)
        specs = [vr.FullAttentionSpec(**kw)] if None not in windows else []
        specs += [vr.SlidingWindowSpec(**kw, sliding_window=w) for w in windows if w]
        config = vr.KVCacheConfig(num_blocks=num_blocks + 1, kv_cache_tensors=[],
                                  kv_cache_groups=[vr.KVCacheGroupSpec([f"layer.{i}"], spec)
                                                   for i, spec in enumerate(specs)])
        self.manager = vr.KVCacheManager(config, max_model_len=1 << 20,
                                         scheduler_block_size=block_size,
                                         hash_block_size=block_size, enable_caching=True,
                                         enable_kv_cache_events=True,
                                         num_hash_lookahead_tokens=lookahead)
        self._hasher = vr.get_request_block_hasher(block_size, vr.sha256, lookahead)
        self.requests: dict = {}
        self._named: dict = {}  # request -> how many of its block hashes are named

    def admit(self, rid, tokens, salt=None, lora=None, mm=None, embeds=None) -> int | None:
        """lora: a vllm.lora.request.LoRARequest; mm: vLLM MultiModalFeatureSpecs (sorted by
        offset); embeds: a prompt-embeddings tensor, one row per token."""
        r = vr.Request(str(rid), list(tokens), vr.SamplingParams(max_tokens=1 << 20), None,
                       block_hasher=self._hasher, cache_salt=salt, lora_request=lora,
                       mm_features=mm, prompt_embeds=embeds)
        self._learn_request(r)
        blocks, hit, _ = self.manager.get_computed_blocks(r)
        if self.manager.allocate_slots(r, r.num_tokens - hit, hit, blocks) is None:
            self._drain()
            return None
        r.num_computed_tokens = r.num_tokens
        self.requests[rid] = r
        self._drain()
        return hit

    def decode(self, rid, token) -> bool:
        """A sampled token joins the request and gets its KV slot; False if the pool has no
        block for it (the token stays known: the caller preempts, as vLLM's scheduler)."""
        r = self.requests[rid]
        r.append_output_token_ids(token)
        self._learn_request(r)
        return self.retry(rid)

    def retry(self, rid) -> bool:
        """The slot for the request's last token again, after a preemption made room."""
        r = self.requests[rid]
        ok = self.manager.allocate_slots(r, 1) is not None
        if ok:
            r.num_computed_tokens += 1
        self._drain()
        return ok

    def tokens(self, rid) -> list[int]:
        return list(self.requests[rid].all_token_ids)

    def free(self, rid) -> None:
        self.manager.free(self.requests.pop(rid))
        self._drain()

    def reset(self) -> bool:
        ok = self.manager.reset_prefix_cache()
        self._drain()
        return ok

    def _learn_request(self, r) -> None:
        n = self._named.get(r.request_id, 0)  # (with lookahead the names run ahead of these)
        new = [vr.maybe_convert_block_hash(h) for h in r.block_hashes[n:]]
        self._named[r.request_id] = len(r.block_hashes)
        self._learn(r.request_id, [None] * n + new, _identity(r), r.all_token_ids)

    def _drain(self) -> None:
        events = self.manager.take_events()
        for r in self.requests.values():  # hashes made within the call (lookahead ones)
            self._learn_request(r)
        if self.on_events is not None and events:
            self.on_events(events)
        for e in events:
            if isinstance(e, vr.BlockStored):
                for h in e.block_hashes:
                    self._stored(h, e.group_idx or 0)
            elif isinstance(e, vr.BlockRemoved):
                for h in e.block_hashes:
                    self._removed(h, e.group_idx or 0)
            elif isinstance(e, vr.AllBlocksCleared):
                self.resident.clear()


def _identity(r):
    """What besides its tokens makes a vLLM request's blocks (the salt alone for plain ones)."""
    if r.lora_request is None and not r.mm_features and r.prompt_embeds is None:
        return r.cache_salt
    lora = r.lora_request and (r.lora_request.lora_name, r.lora_request.lora_path)
    mm = tuple((f.identifier, f.mm_position.offset, f.mm_position.length) for f in r.mm_features)
    embeds = None if r.prompt_embeds is None else \
        hashlib.sha256(r.prompt_embeds.numpy().tobytes()).hexdigest()
    return r.cache_salt, lora, mm, embeds


class OurSide(_Side):
    """kvscope's KVCacheManager, driven with the same calls its scheduler makes."""

    def __init__(self, num_blocks: int, block_size: int = 16, policy: str = "lru",
                 windows: tuple = ()):
        """windows: as VllmSide's."""
        super().__init__(block_size)
        groups = (() if None in windows else (KVGroup(),)) + tuple(
            KVGroup(w) for w in windows if w)
        self.manager = KVCacheManager(num_blocks, block_size, eviction_policy=policy,
                                      groups=groups)
        self.salts: dict = {}
        self.known: dict = {}
        self._hash_of_block: dict[int, int] = {}  # block -> short hash, from CACHED events
        self._chains: dict = {}  # request -> our chain hashes of its full blocks so far

    def admit(self, rid, tokens, salt=None) -> int | None:
        self.salts[rid], self.known[rid] = salt, list(tokens)
        self._learn_tokens(rid)
        hit = self.manager.admit(rid, list(tokens), cache_salt=salt)
        self._drain()
        return hit

    def decode(self, rid, token) -> bool:
        """As VllmSide.decode."""
        self.known[rid].append(token)
        self._learn_tokens(rid)
        self.manager.append_token_ids(rid, [token])
        return self.retry(rid)

    def retry(self, rid) -> bool:
        if not self.manager.can_allocate(rid, 1):
            return False
        self.manager.allocate(rid, 1)
        self._drain()
        return True

    def tokens(self, rid) -> list[int]:
        return list(self.known[rid])

    def free(self, rid) -> None:
        self.manager.free(rid)
        self._drain()

    def reset(self) -> bool:
        self.manager.reset_prefix_cache()
        self._drain()
        return True

    def _learn_tokens(self, rid) -> None:
        salt, tokens = self.salts[rid], self.known[rid]
        chain = self._chains.setdefault(rid, [])
        parent = chain[-1] if chain else root_hash(ExtraKeys("", None, salt or None))
        chain += hash_blocks(parent, tokens, self.block_size, len(chain))
        self._learn(rid, [short_hash(h) for h in chain], salt, tokens)

    def _drain(self) -> None:
        for e in self.manager.events.drain():
            if e.kind == ev.CACHED:
                for b, h in zip(e.blocks, e.block_hashes, strict=True):
                    self._hash_of_block[b] = h, e.group
                    self._stored(h, e.group)
            elif e.kind == ev.EVICTED:
                for b in e.blocks:
                    self._removed(*self._hash_of_block.pop(b))
            elif e.kind == ev.RESET:
                self.resident.clear()
                self._hash_of_block.clear()
