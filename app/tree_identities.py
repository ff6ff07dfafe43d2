"""What each root of the prefix tree stands for (no Qt): learnt from the frames, the requests'
salts (or their digests in a replay) and, for an attached server, the source's own root names."""

from __future__ import annotations

from kvscope.app.frames import Frame
from kvscope.app.prefix_tree import TreeNode, walk


class Identities:
    """What each root of the tree stands for. A root is one identity: the digest of the model,
    the adapter and the cache salt that every chain under it starts from (the short parent hash
    of its first blocks). The frames carry each request's salt (in a replay, a digest of it) and
    the pool its block tables: a request whose first block hangs under a root names the root's
    salt, remembered for as long as the source is shown. This engine serves no adapters: the
    model and the salt make the identity."""

    def __init__(self):
        self.model = ""
        self.digests = False  # salts are digests (a replay never stores the salts themselves)
        self.salts: dict[int, str | None] = {}  # request -> its salt
        self.of_root: dict[int, str | None] = {}  # root key -> the salt of its chains
        self.named: dict[int, str] = {}  # root key -> label, from the source (an attachment)

    def reset(self, model: str = "", digests: bool = False) -> None:
        self.model, self.digests = model, digests
        self.salts.clear()
        self.of_root.clear()
        self.named.clear()

    def learn(self, frame: Frame) -> None:
        if frame.root_names:
            self.named.update(frame.root_names)
        if frame.requests is not None:
            self.salts.update((r.request_id, r.cache_salt) for r in frame.requests)
        snap = frame.snapshot
        if snap is not None:
            for rid, table in snap.block_tables.items():
                if len(table) and rid in self.salts:
                    key = int(snap.parent_hash[table[0]])
                    if key and key not in self.of_root:
                        self.of_root[key] = self.salts[rid]

    def _salt(self, key: int) -> str:
        salt = self.of_root[key]
        if salt is None:
            return "no salt"
        if self.digests:
            return f"salt #{salt[:6]}"
        return f"salt {salt if len(salt) <= 14 else salt[:13] + '…'}"

    def labels(self, root: TreeNode) -> list[str]:
        """The root's label, longest first: the window tries each until one fits."""
        if root.key == 0:
            return ["first blocks not hashed yet", "no hash yet"]
        model = f"{self.model} · " if self.model else ""
        if root.key in self.named:  # an attached server's identity: adapter and salt digest
            name, parts = self.named[root.key], self.named[root.key].split(" · ")
            return [name, " · ".join(parts[:2]), min(parts[:2], key=len)]
        if root.key in self.of_root:
            salt = self._salt(root.key)
            return [model + salt, salt, salt.removeprefix("salt ")]
        digest = f"{root.key:016x}"[:8]
        return [f"{model}identity {digest}…", f"id {digest}…"]

    def words(self, root: TreeNode) -> str:
        below = sum(1 for _ in walk([root])) - 1
        if root.key == 0:
            return (f"root of the blocks without a hash yet (a prompt's first block not full, "
                    f"or not written yet) · {below} node(s) below")
        if root.key in self.named:
            return (f"root: identity {root.key:016x} = {self.named[root.key]} · {below} "
                    "node(s) below; chains of other identities never share blocks")
        if root.key in self.of_root:
            salt = self.of_root[root.key]
            who = ("no cache salt" if salt is None else
                   f"cache salt digest {salt} (equal digests: equal salts, in this session)"
                   if self.digests else f"cache salt {salt!r}")
        else:
            who = "no request seen under it yet: salt unknown"
        return (f"root: identity {root.key:016x} = model {self.model or '?'} · {who} · "
                f"{below} node(s) below; chains of other identities never share blocks")
