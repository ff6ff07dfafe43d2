"""Hash parity against vLLM 0.33's own KVCacheManager and ZmqEventPublisher: events of salted,
LoRA, multimodal, prompt-embeds and lookahead traffic, published on loopback, attached to with
kvscope's Attachment (and `kvscope attach --headless`), every block recomputed with the rule of
the server's version. Also the untagged rule of vLLM 0.17 to 0.30 (vLLM's own manager with its
extra keys written in that form) and a planted wrong tag, which must be reported."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import vllm_ref as vr
from traffic import multi_turn, play
from vllm_server import VllmServer

from kvscope.sessions.kv_events import Attachment, Mirror
from kvscope.sessions.kv_events.parity import HashParity, HashSettings
from kvscope.sessions.kv_events.slots import HashSlots, short_key
from kvscope.sessions.kv_events.vllm_rules import LORA_PATH, UNKNOWN_FORM


def loras() -> dict:
    return {"tenant-0": vr.LoRARequest("adapter-a", 1, "/adapters/a"),
            "tenant-1": vr.LoRARequest("adapter-b", 2, "/adapters/b")}


PATHS = {"adapter-a": "/adapters/a", "adapter-b": "/adapters/b"}


class Publishing:
    """A VllmSide whose every call is one scheduler step: its events go out as one batch.
    lora_of: salt -> the LoRARequest the requests of that salt use instead (keep: the salts
    kept beside their adapter)."""

    def __init__(self, server: VllmServer, lora_of=None, keep=()):
        self.server, self.side = server, server.side
        self.lora_of, self.keep = lora_of or {}, keep

    def admit(self, rid, tokens, salt=None, **kw):
        lora = self.lora_of.get(salt)
        if lora is not None:
            kw["lora"] = lora
            salt = salt if salt in self.keep else None
        return self._step(self.side.admit(rid, tokens, salt, **kw))

    def decode(self, rid, token):
        return self._step(self.side.decode(rid, token))

    def retry(self, rid):
        return self._step(self.side.retry(rid))

    def free(self, rid):
        return self._step(self.side.free(rid))

    def _step(self, result):
        self.server.step()
        return result

    def __getattr__(self, name):
        return getattr(self.side, name)


@pytest.fixture
def server():
    s = VllmServer(num_blocks=64)
    yield s
    s.close()


def attach(server: VllmServer, **settings) -> Mirror:
    """Everything the server published, read back through its replay endpoint."""
    return attach_slots(server, **settings).mirror


def attach_slots(server: VllmServer, **settings) -> HashSlots:
    """The same, shown as hash slots (the attach view's pool and tree), after one tick."""
    server.wait_published()
    mirror = Mirror(HashParity(HashSettings(**settings)))
    slots = HashSlots(mirror)
    a = Attachment(server.endpoint, server.replay, mirror=mirror, replay_timeout_s=5.0).start()
    a.close()
    assert a.last == server.num_batches - 1 and mirror.health.lost == 0
    slots.tick(0.0, 0.25)
    return slots


def verdict(m: Mirror) -> tuple[int, int, dict]:
    p = m.parity
    assert p.matched + p.mismatched + sum(p.unverifiable.values()) == m.num_stored
    return p.matched, p.mismatched, dict(p.unverifiable)


def salt_of_resident(server: VllmServer) -> dict:
    """vLLM's own view: resident hash -> the salt of the request that made it (None: none)."""
    side = server.side
    return {h: side.name_of[h][0] for h in side.name_of if side.resident[side.name_of[h]]}


def test_salted_traffic_verifies_every_block_and_shows_each_salt_as_a_root(server):
    play(Publishing(server), multi_turn(1))
    for settings in ({"vllm_version": "0.33.0"}, {}):  # the version given, or detected
        slots = attach_slots(server, **settings)
        m = slots.mirror
        assert verdict(m) == (m.num_stored, 0, {}), m.parity.lines()
    assert "extra keys tagged (vLLM >= 0.31), detected from the stream" in m.summary()
    # identity: every resident block under its chain's salt (children inherit it from block 0)
    salts = salt_of_resident(server)
    assert len(salts) == m.num_resident and {s for s in salts.values() if s} == \
        {"tenant-0", "tenant-1"}
    for h, salt in salts.items():
        assert m.blocks[(0, 0, "GPU", h)][3] == (None, salt and m.salt_digest(salt))
    summary = m.summary()
    for salt in ("tenant-0", "tenant-1"):
        n = sum(s == salt for s in salts.values())
        assert f"identity lora=none salt=#{m.salt_digest(salt)[:8]}: {n} blocks" in summary
        assert salt not in summary  # the digest, never the salt
    # the slot view: a chain's first block hangs under the root of its salt
    snap = slots.snapshot()
    roots = slots.roots()
    firsts = {k[3]: slot for k, slot in slots.slot_of.items() if m.blocks[k][1] is None}
    for h, slot in firsts.items():
        root = short_key("root", 0, 0, "GPU", None, salts[h] and m.salt_digest(salts[h]))
        assert int(snap.parent_hash[slot]) == root
        assert roots[root] == ("no LoRA · " + (f"salt #{m.salt_digest(salts[h])[:8]}"
                                               if salts[h] else "no salt"))
    assert len(roots) == 3


def test_lora_traffic_verifies_with_the_adapter_paths_and_is_unverifiable_without(server):
    play(Publishing(server, loras(), keep={"tenant-0"}), multi_turn(2))  # a + salt; b, no salt
    m = attach(server, vllm_version="0.33", lora_paths=PATHS)
    assert verdict(m) == (m.num_stored, 0, {}), m.parity.lines()
    lora_blocks = sum(len(e.block_hashes) for e in server_stores(server) if e.lora_name)
    assert 0 < lora_blocks < m.num_stored
    m = attach(server, vllm_version="0.33")  # no --lora-path: those blocks are unverifiable
    assert verdict(m) == (m.num_stored - lora_blocks, 0, {LORA_PATH: lora_blocks})
    m = attach(server, lora_paths=PATHS)  # the form detected from the stream
    assert verdict(m)[1:] == (0, {})
    wrong = attach(server, vllm_version="0.33", lora_paths={**PATHS, "adapter-b": "/other"})
    assert wrong.parity.mismatched > 0  # the path is part of the hash: a wrong one differs
    # identity: LoRA chains under their adapter (and salt)
    summary = m.summary()
    assert f"identity lora=adapter-a salt=#{m.salt_digest('tenant-0')[:8]}:" in summary
    assert "identity lora=adapter-b salt=none:" in summary
    slots = attach_slots(server, lora_paths=PATHS)
    assert set(slots.roots().values()) == {
        "no LoRA · no salt", "LoRA adapter-b · no salt",
        f"LoRA adapter-a · salt #{slots.mirror.salt_digest('tenant-0')[:8]}"}


def server_stores(server: VllmServer) -> list:
    """Every BlockStored the server published."""
    return [e for e in server.sent if isinstance(e, vr.BlockStored)]


def image(identifier: str, offset: int, length: int):
    return vr.MultiModalFeatureSpec(None, "image", identifier,
                                    vr.PlaceholderRange(offset, length))


def test_multimodal_prompt_embeds_and_lookahead_blocks_verify():
    for lookahead in (0, 2):
        server = VllmServer(num_blocks=64, lookahead=lookahead)
        try:
            pub = Publishing(server)
            prompt = list(range(100, 164))
            pub.admit(0, prompt, mm=[image("img-1", 5, 20), image("img-2", 30, 4)])
            for t in range(7, 27):
                pub.decode(0, t)
            pub.free(0)
            pub.admit(1, prompt, "tenant-0", mm=[image("img-1", 20, 20)])  # another offset
            pub.free(1)
            torch.manual_seed(0)
            pub.admit(2, list(range(48)), embeds=torch.randn(48, 8))
            for t in range(20):
                pub.decode(2, t)
            m = attach(server, vllm_version="0.33.0")
            assert verdict(m) == (m.num_stored, 0, {}), m.parity.lines()
            stores = server_stores(server)
            kinds = {type(k).__name__ for e in stores for ks in e.extra_keys or () if ks
                     for k in ks}
            assert kinds == {"tuple", "str", "bytes"}  # mm pairs, the salt, embeds digests
            assert all((e.lookahead_token_ids is not None) == bool(lookahead) for e in stores)
        finally:
            server.close()


def test_the_untagged_rule_of_vllm_0_30_stays_correct(server, monkeypatch):
    """vLLM's own manager with its extra keys written as 0.17 to 0.30 did: hashed untagged
    (LoRA by name, (identifier, offset), the salt, the digest) and published as hashed."""
    tagged = vr.kv_cache_utils.generate_block_hash_extra_keys

    def untagged(*args):
        keys, mm_idx = tagged(*args)
        event_keys = None if keys is None else vr.kv_cache_utils.to_event_extra_keys([keys])[0]
        return event_keys, mm_idx

    for module in (vr.kv_cache_utils, vr.block_pool):
        monkeypatch.setattr(module, "generate_block_hash_extra_keys", untagged)
    monkeypatch.setattr(vr.block_pool, "to_event_extra_keys", lambda keys: keys or None)
    # (both are looked up when called: the server's manager and hasher use the patched ones)
    play(Publishing(server, {"tenant-0": loras()["tenant-0"]}), multi_turn(3))
    # (a 0.17 server drew a random NONE_HASH unless PYTHONHASHSEED was set: this one's is
    # vLLM's fixed seed, as if PYTHONHASHSEED=vllm-none-hash)
    for settings in ({"vllm_version": "0.30.0"}, {"vllm_version": "0.17", "seed": "vllm-none-hash"},
                     {}):
        m = attach(server, **settings)
        assert verdict(m) == (m.num_stored, 0, {}), (settings, m.parity.lines())
    assert "untagged (vLLM 0.17 to 0.30), detected from the stream" in m.summary()
    m = attach(server, vllm_version="0.17")
    assert verdict(m) == (0, 0, {"NONE_HASH unknown (random seed)": m.num_stored})
    told = attach(server, vllm_version="0.33.0", lora_paths=PATHS)  # the wrong rule differs
    assert told.parity.mismatched > 0


def planted(server: VllmServer, extra: tuple, tokens: list[int], parent=None):
    """A store whose hash vLLM's own hash_block_tokens computed with `extra` as the extra
    keys, published untagged by vLLM's to_event_extra_keys."""
    digest = vr.hash_block_tokens(vr.sha256, parent, tokens, extra)
    server.pending.append(vr.BlockStored(
        block_hashes=[vr.maybe_convert_block_hash(digest)],
        parent_block_hash=None if parent is None else vr.maybe_convert_block_hash(parent),
        token_ids=tokens, block_size=len(tokens), lora_id=None, medium="GPU", lora_name=None,
        extra_keys=vr.kv_cache_utils.to_event_extra_keys([extra])))
    server.step()
    return digest


def test_a_planted_wrong_tag_is_reported_as_a_mismatch(server):
    good = planted(server, (("cache_salt", "tenant-x"),), list(range(16)))
    planted(server, None, list(range(16, 32)), parent=good)  # a verified salted child
    planted(server, (("salt", "tenant-y"),), list(range(32, 48)))  # the wrong tag
    for settings in ({"vllm_version": "0.33.0"}, {}):  # given, or detected from the first
        m = attach(server, **settings)
        assert verdict(m) == (2, 1, {}), m.parity.lines()
        assert "mismatch: published" in m.summary()
    only = VllmServer(num_blocks=8)  # the wrong tag alone, no version: nothing to tell by
    try:
        planted(only, (("salt", "tenant-y"),), list(range(16)))
        assert verdict(attach(only)) == (0, 0, {UNKNOWN_FORM: 1})
    finally:
        only.close()


def test_headless_attach_checks_salted_lora_traffic_with_the_options(server):
    play(Publishing(server, loras(), keep={"tenant-0"}), multi_turn(4))
    server.wait_published()
    base = [sys.executable, "-m", "kvscope.app", "attach", server.endpoint, "--replay",
            server.replay, "--headless", "--duration", "1.5", "--hash-check", "sha256",
            "--vllm-version", "0.33.0"]
    paths = [f"--lora-path={n}={p}" for n, p in PATHS.items()]
    out = subprocess.run(base + paths, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    stored = int(out.stdout.splitlines()[-1].split("blocks stored: ")[1].split(",")[0])
    assert stored > 0
    assert f"hash parity (sha256, seed given): {stored} blocks match, 0 differ" in out.stdout
    assert "rules: vLLM 0.33.0 (--vllm-version; rule of 0.33.0)" in out.stdout
    assert "unverifiable" not in out.stdout and "tenant-" not in out.stdout
    assert "identity lora=adapter-a salt=#" in out.stdout
    out = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and " 0 differ" in out.stdout
    assert "blocks: LoRA adapter path unknown" in out.stdout
