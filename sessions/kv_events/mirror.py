"""A mirror of a remote engine's prefix cache, rebuilt from its KV events, and its health.

Blocks are keyed by (data-parallel rank, KV group, medium, hash): the same hash may be resident
in several groups and tiers at once, and a server with duplicate physical copies of one hash sends
a store (and later a remove) for each copy, so a key holds a reference count. Physical block ids
are not published: the mirror knows hash slots, not pool cells. Each KV group's spec (vLLM's
`kv_cache_spec_kind` and `kv_cache_spec_sliding_window` on its stores) is learnt from the stores;
stores of one group that disagree on it are counted in the health, and the latest is kept.

Tiers (vLLM's `medium`: "GPU", "CPU", "STORAGE"): a hash's residency is the set of tiers holding
it (`residency`). vLLM 0.33's offloading connector publishes its tiers in two forms: placeholder
stores (the default: one per offload key, naming the chunk's last hash, with no tokens, no parent
and block_size 0) and self-describing stores (`self_describing_kv_events`: the chunk's hashes,
parent, tokens and block size, as a GPU store). Both are mirrored by their hashes. A removal of a
hash the mirror does not hold in that tier is counted per tier, and as an orphan (history not
seen: a store was missed) only where the tier's form allows the conclusion, that is where each
removal names the hashes its store named: the GPU tier, and a tier whose stores all came in one
form. Not in a tier that mixes them: with self-describing events on, vLLM falls back to a
placeholder for a chunk whose metadata it lacks, and a later removal that has the metadata fans
out to hashes the placeholder never named. Not in a tier no store has shown the form of. Nor, in
a tier other than GPU, after an AllBlocksCleared: vLLM publishes one when it resets the GPU pool,
leaving the connector's tiers as they were by default (reset_connector=False), while the mirror
drops every tier on it, so a later removal there may name a block stored before it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import Counter, deque
from dataclasses import dataclass, field

from kvscope.engine.kv_groups import ONE_GROUP, KVGroup
from kvscope.sessions.kv_events.vllm_rules import published_salt
from kvscope.sessions.kv_events.wire import Batch, Cleared, Removed, Stored

MAX_NOTES = 20


@dataclass
class Health:
    """How far the mirror can be trusted: what was missed, repaired, or never seen."""

    gaps: int = 0  # times the sequence jumped forward
    missing: int = 0  # batches skipped over by those jumps
    repaired: int = 0  # gaps whose every batch came back through replay
    replayed: int = 0  # batches recovered through replay (on attach and on gaps)
    lost: int = 0  # batches of a gap that replay did not return
    orphans: int = 0  # stored chains whose parent hash was not resident (history not seen)
    duplicate_stores: int = 0  # a store of a key already resident (another physical copy)
    unknown_removes: int = 0  # a remove of a key the mirror does not hold
    unknown_removes_by_medium: Counter = field(default_factory=Counter)  # tier -> those removes
    orphan_removes: int = 0  # of those, removes that prove a store was missed (see the module)
    restarts: int = 0  # the sequence went back, or a replay showed a new lifetime
    disconnects: int = 0  # times a stream's connection dropped
    spec_conflicts: int = 0  # stores of a KV group that named another spec than the one before
    unsure: set = field(default_factory=set)  # endpoints disconnected since a replay answered
    bad_messages: int = 0  # frames or payloads that are not KV-event batches
    first_seq: dict = field(default_factory=dict)  # stream endpoint -> first sequence applied
    notes: deque = field(default_factory=lambda: deque(maxlen=MAX_NOTES))

    def note(self, text: str) -> None:
        self.notes.append(text)

    def lines(self) -> list[str]:
        recovered = ("no batches missed" if not self.missing else
                     f"{self.missing - self.lost} of {self.missing} missed batches recovered")
        if self.unsure:
            recovered = ("" if not self.missing else recovered + "; ") + \
                "may have missed batches since a disconnect from " + \
                ", ".join(sorted(self.unsure)) + " (until a replay answers)"
        late = {e: s for e, s in self.first_seq.items() if s > 0}
        if not self.first_seq:
            history = "nothing received"
        elif not late:
            history = "from sequence 0 (the publisher's start)"
        else:
            history = ", ".join(f"{e} from sequence {s}" for e, s in late.items()) + \
                " (earlier blocks were never seen: expect orphan parents)"
        lines = [
            f"gaps: {self.gaps} ({self.repaired} repaired by replay, {self.lost} batches lost); "
            f"replay: {self.replayed} batches, {recovered}",
            f"history: {history}",
            f"orphan parents: {self.orphans}, duplicate stores: {self.duplicate_stores}, "
            f"removes of unknown blocks: {self.unknown_removes}" + self._by_tier(),
            f"publisher restarts: {self.restarts}, bad messages: {self.bad_messages}, "
            f"disconnects: {self.disconnects}",
        ]
        if self.spec_conflicts:
            lines.append(f"KV group spec conflicts: {self.spec_conflicts} (stores of one group "
                         "named different kinds or windows; the latest is shown)")
        return lines

    def _by_tier(self) -> str:
        if not self.unknown_removes:
            return ""
        tiers = ", ".join(f"{m} {n}" for m, n in sorted(self.unknown_removes_by_medium.items()))
        return f" ({tiers}; orphans, a store missed: {self.orphan_removes})"


PLACEHOLDER, SELF_DESCRIBING = "placeholder", "self-describing"


def store_form(e: Stored) -> str:
    """vLLM's two forms of a tier's store: a placeholder (the offloading connector's legacy
    payload: no token ids, block_size 0) or self-describing (every GPU store)."""
    return PLACEHOLDER if not e.token_ids and not e.block_size else SELF_DESCRIBING


class Mirror:
    def __init__(self, parity=None):
        self.parity = parity  # a HashParity that checks every store, or None
        # key -> [refs, parent hash, block_size, identity: (LoRA name, salt digest)]
        self.blocks: dict[tuple, list] = {}
        self._salt_key = secrets.token_bytes(32)  # never kept: salts are shown as digests
        self._where: Counter = Counter()  # (rank, group, hash) -> keys holding it (any medium)
        # (rank, group) -> (spec kind, sliding window) its latest store published
        self.specs: dict[tuple[int, int], tuple[str, int | None]] = {}
        self.group_ids: set[int] = set()  # every KV group a store named
        self.forms: dict[tuple[int, str], set[str]] = {}  # (rank, medium) -> forms of its stores
        self._cleared_ranks: set[int] = set()  # ranks an AllBlocksCleared was applied to
        self.num_stored = 0  # block stores applied (duplicates included)
        self.num_removed = 0  # block removes applied to a resident key
        self.num_cleared = 0  # block references dropped by AllBlocksCleared and restarts
        self.num_resets = 0  # AllBlocksCleared events applied
        self.evictions: Counter = Counter()  # whole second of the batch timestamp -> removes
        self.health = Health()
        # A fleet's instances (one per rank): each its own health and hash parity
        self.healths: dict[int, Health] = {}
        self.parities: dict[int, object] = {}
        # When a list: ("+", key, entry) for each key that became resident, ("-", key) for each
        # that stopped being, in order (the hash-slot view drains it: see slots.py).
        self.journal: list | None = None

    # ---------------------------------------------------------------------- applying
    def apply(self, batch: Batch) -> None:
        rank = batch.dp_rank
        for e in batch.events:
            if isinstance(e, Stored):
                self._store(rank, e)
            elif isinstance(e, Removed):
                self._remove(rank, e, batch.ts)
            elif isinstance(e, Cleared):
                self.num_resets += 1
                self._cleared_ranks.add(rank)
                self.clear(rank)

    def _store(self, rank: int, e: Stored) -> None:
        blocks, where, group, medium = self.blocks, self._where, e.group, e.medium
        identity = self._identity(rank, e)
        health, parity = self.health_of(rank), self.parities.get(rank, self.parity)
        if parity is not None:
            parity.check(e)
        self.group_ids.add(group)
        self.forms.setdefault((rank, medium), set()).add(store_form(e))
        if e.spec_kind is not None:
            self._learn_spec(rank, group, (e.spec_kind, e.sliding_window))
        parent = e.parent
        if parent is not None and not where[(rank, group, parent)]:
            health.orphans += 1
        for h in e.hashes:
            key = (rank, group, medium, h)
            entry = blocks.get(key)
            if entry is None:
                blocks[key] = entry = [1, parent, e.block_size, identity]
                where[(rank, group, h)] += 1
                if self.journal is not None:
                    self.journal.append(("+", key, entry))
            else:
                entry[0] += 1
                health.duplicate_stores += 1
            parent = h
        self.num_stored += len(e.hashes)

    def _learn_spec(self, rank: int, group: int, spec: tuple) -> None:
        known = self.specs.get((rank, group))
        if known is not None and known != spec:
            self.health_of(rank).spec_conflicts += 1
            self.health_of(rank).note(f"dp rank {rank}, KV group {group}: a store names "
                             f"{KVGroup.of_spec(*spec).name}, an earlier one "
                             f"{KVGroup.of_spec(*known).name}")
        self.specs[(rank, group)] = spec

    def _identity(self, rank: int, e: Stored) -> tuple:
        """(LoRA name, salt digest): SGLang names the salt on the event, vLLM puts it in the
        extra keys of a chain's first block only, so a continuing store takes its parent's."""
        salt = e.cache_salt
        if salt is None and e.parent is None and e.extra_keys:
            salt = published_salt(e.extra_keys[0], e.lora_name)
        if salt is not None:
            return e.lora_name, self.salt_digest(salt)
        up = None
        if e.parent is not None:  # the parent in this tier, else in any tier holding it
            tiers = (e.medium, *sorted(self.residency(e.group, e.parent, rank)))
            up = next(filter(None, (self.blocks.get((rank, e.group, m, e.parent))
                                    for m in tiers)), None)
        return e.lora_name, up[3][1] if up is not None else None

    def salt_digest(self, salt: str) -> str:
        """Equal digests are equal salts, within this mirror only (a key of its own)."""
        return hmac.new(self._salt_key, salt.encode("utf-8", "surrogatepass"),
                        hashlib.sha256).hexdigest()[:16]

    def _remove(self, rank: int, e: Removed, ts: float) -> None:
        blocks, n = self.blocks, 0
        for h in e.hashes:
            key = (rank, e.group, e.medium, h)
            entry = blocks.get(key)
            if entry is None:
                self._unknown_remove(rank, e.medium)
                continue
            n += 1
            entry[0] -= 1
            if entry[0] == 0:
                del blocks[key]
                self._forget(rank, e.group, h)
                if self.journal is not None:
                    self.journal.append(("-", key))
        self.num_removed += n
        self.evictions[int(ts)] += n

    def _unknown_remove(self, rank: int, medium: str) -> None:
        """A remove of a key not held: an orphan only where the tier's form allows it (see the
        module's docstring)."""
        h = self.health_of(rank)
        h.unknown_removes += 1
        h.unknown_removes_by_medium[medium] += 1
        if medium == "GPU" or (len(self.forms.get((rank, medium), ())) == 1
                               and rank not in self._cleared_ranks):
            h.orphan_removes += 1

    def _forget(self, rank: int, group: int, h) -> None:
        where = self._where
        where[(rank, group, h)] -= 1
        if not where[(rank, group, h)]:
            del where[(rank, group, h)]

    def clear(self, rank: int) -> None:
        """Drop every block of one data-parallel rank (AllBlocksCleared, a publisher restart)."""
        for key in [k for k in self.blocks if k[0] == rank]:
            self.num_cleared += self.blocks.pop(key)[0]
            self._forget(rank, key[1], key[3])
            if self.journal is not None:
                self.journal.append(("-", key))

    def health_of(self, rank: int) -> Health:
        """The health a rank's events count in: its fleet instance's, else the mirror's."""
        return self.healths.get(rank, self.health)

    # ---------------------------------------------------------------------- queries
    @property
    def num_resident(self) -> int:
        return len(self.blocks)

    def groups(self) -> tuple[KVGroup, ...]:
        """The server's KV groups by group_idx, as their stores described them (the lowest dp
        rank's spec; "kind unknown" for a group no store described: older vLLM, SGLang)."""
        if not self.group_ids:
            return ONE_GROUP
        specs: dict[int, tuple] = {}
        for (_, group), spec in sorted(self.specs.items(), reverse=True):
            specs[group] = spec
        return tuple(KVGroup.of_spec(*specs.get(g, (None, None)))
                     for g in range(max(self.group_ids) + 1))

    def group_label(self, rank: int, group: int) -> str:
        """"KV group 1 (sliding window 8)"; no kind when none was published."""
        spec = self.specs.get((rank, group))
        return f"KV group {group}" + (f" ({KVGroup.of_spec(*spec).name})" if spec else "")

    def tree(self, rank: int = 0, group: int = 0, medium: str = "GPU") -> dict:
        """hash -> parent hash (None for a chain's first block) of the resident blocks."""
        return {k[3]: v[1] for k, v in self.blocks.items()
                if k[0] == rank and k[1] == group and k[2] == medium}

    def residency(self, group: int, block_hash, rank: int = 0) -> frozenset[str]:
        """The tiers (media) holding a hash of a KV group: {"GPU", "CPU"} for a block offloaded
        and still on the device, {} for one held nowhere."""
        return frozenset(m for r, m in self.forms if r == rank
                         and (rank, group, m, block_hash) in self.blocks)

    def tiers(self) -> dict[str, tuple[int, set[str]]]:
        """medium -> (resident blocks, the forms of its stores), GPU first."""
        out: dict[str, list] = {}
        for (_, medium), forms in self.forms.items():
            out.setdefault(medium, [0, set()])[1].update(forms)
        for _, _, medium, _ in self.blocks:
            out[medium][0] += 1
        return {m: tuple(out[m]) for m in sorted(out, key=lambda m: (m != "GPU", m))}

    def refs(self, rank: int, group: int, medium: str, block_hash) -> int:
        entry = self.blocks.get((rank, group, medium, block_hash))
        return entry[0] if entry else 0

    def layers(self) -> dict[tuple, tuple[int, int, int]]:
        """(rank, group, medium) -> (resident blocks, tokens, chain roots); a chain root is a
        block whose parent is not resident, so each root starts one prefix tree."""
        out: dict[tuple, list[int]] = {}
        for (rank, group, medium, _), (_, parent, size, _) in self.blocks.items():
            row = out.setdefault((rank, group, medium), [0, 0, 0])
            row[0] += 1
            row[1] += size
            row[2] += parent is None or not self._where[(rank, group, parent)]
        return {k: tuple(v) for k, v in sorted(out.items(), key=lambda kv: str(kv[0]))}

    def identities(self) -> Counter:
        """(LoRA name, salt digest) -> resident blocks."""
        return Counter(v[3] for v in self.blocks.values())

    def summary(self) -> str:
        lines = ["cache (hash slots: physical block ids are not published):"]
        for (rank, group, medium), (n, tokens, roots) in self.layers().items():
            lines.append(f"  dp rank {rank}, {self.group_label(rank, group)}, {medium}: "
                         f"{n} blocks, {tokens} tokens, {roots} chain roots")
        if not self.blocks:
            lines.append("  (empty)")
        named = {k: v for k, v in self.identities().items() if k != (None, None)}
        for (lora, salt), n in sorted(named.items(), key=str):
            shown = f"#{salt[:8]}" if salt else "none"
            lines.append(f"  identity lora={lora or 'none'} salt={shown}: {n} blocks")
        if self.evictions:
            lines.append(f"  removals: {self.num_removed} over {len(self.evictions)} s "
                         f"(busiest second: {max(self.evictions.values())}); "
                         f"cleared: {self.num_cleared}")
        if self.num_resets:
            lines.append(f"  resets (AllBlocksCleared): {self.num_resets}, blocks cleared "
                         f"(resets and restarts): {self.num_cleared}")
        if self.parity is not None:
            lines += self.parity.lines()
        lines.append("health:")
        lines += [f"  {line}" for line in self.health.lines()]
        lines += [f"  note: {n}" for n in self.health.notes]
        h = self.health
        lines.append(f"blocks stored: {self.num_stored}, removed: {self.num_removed}, "
                     f"resident: {self.num_resident}, gaps: {h.gaps}, repaired: {h.repaired}, "
                     f"orphans: {h.orphans}, restarts: {h.restarts}")
        return "\n".join(lines)
