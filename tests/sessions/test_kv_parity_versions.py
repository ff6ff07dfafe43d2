"""Hash parity per vLLM release: tagged keys rebuilt from untagged events, the form known from
--vllm-version or found from the stream, reasons for what cannot be known, and the identity of a
salted vLLM chain (its salt is in its first block's extra keys only)."""

import hashlib
import pickle

import pytest

from kvscope.sessions.kv_events import Batch, Mirror, Stored
from kvscope.sessions.kv_events.parity import (
    INT_DIGESTS,
    LORA_NOT_PUBLISHED,
    PARENT_DIFFERS,
    HashParity,
    HashSettings,
    lora_paths,
)
from kvscope.sessions.kv_events.vllm_rules import (
    LORA_PATH,
    RULES,
    UNKNOWN_FORM,
    UnknownKeys,
    parse_version,
    published_salt,
    rule_for,
    tagged,
)

BS = 4
SEED = "vllm-none-hash"


def h(obj) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def chain(tokens, keys, parent=None):
    """vLLM's hash_block_tokens (sha256) over full blocks; keys[i]: block i's extra keys."""
    parent, out = parent or h(SEED), []
    for i in range(len(tokens) // BS):
        parent = h((parent, tuple(tokens[i * BS:(i + 1) * BS]), keys[i]))
        out.append(parent)
    return out


def low(d: bytes) -> int:
    return int.from_bytes(d, "big") & ((1 << 64) - 1)


def verdict(p: HashParity):
    return p.matched, p.mismatched, dict(p.unverifiable)


def test_the_rule_of_each_release():
    assert parse_version("0.33") == (0, 33, 0) and parse_version("0.9.0.1") == (0, 9, 0)
    assert parse_version("v0.34.0rc1") == (0, 34, 0) and parse_version("0.27.1.post2") == (0, 27, 1)
    assert [r.since for r in RULES] == sorted(r.since for r in RULES)
    r = {v: rule_for(parse_version(v)) for v in ("0.9.0", "0.10.1", "0.10.2", "0.16.0", "0.17",
                                                  "0.28.0", "0.29", "0.30.0", "0.31", "0.33.4")}
    assert [k for k, x in r.items() if x.digests == "int"] == ["0.9.0", "0.10.1"]
    assert [k for k, x in r.items() if x.published] == ["0.17", "0.28.0", "0.29", "0.30.0",
                                                         "0.31", "0.33.4"]
    assert [k for k, x in r.items() if x.tagged] == ["0.31", "0.33.4"]
    assert [k for k, x in r.items() if x.fixed_seed] == ["0.29", "0.30.0", "0.31", "0.33.4"]
    assert r["0.30.0"].lora == "name" and r["0.31"].lora == "name+path"
    assert rule_for((0, 34, 0)) is None and rule_for((1, 0, 0)) is None  # newer: not known
    for bad, words in (("abc", "not a vLLM version"), ("0.8.5", "since 0.9.0"), ("", "not a")):
        with pytest.raises(ValueError, match=words):
            parse_version(bad)


def test_tagging_an_untagged_entry_back():
    entry = ["ad", ["img", 3], ["img", 19], "tenant", b"\x01" * 32]
    assert tagged(entry, "ad", {"ad": "/p"}) == (
        ("lora", "ad", "/p"), ("mm", "img", 3), ("mm", "img", 19), ("cache_salt", "tenant"),
        ("prompt_embeds", b"\x01" * 32))
    assert published_salt(entry, "ad") == "tenant" and published_salt(["ad"], "ad") is None
    for bad, why in (((entry, "ad", {}), LORA_PATH), ((entry, "other", {"other": "/p"}),
                     UNKNOWN_FORM), (([1.5], None, {}), UNKNOWN_FORM)):
        with pytest.raises(UnknownKeys, match=why.split(" (")[0]):
            tagged(*bad)


def test_a_salted_chain_of_vllm_0_33_verifies_block_0_and_its_later_children():
    tokens = list(range(16))
    d = chain(tokens, [(("cache_salt", "t"),), None, None, None])
    for settings in (HashSettings(vllm_version="0.33.0"), HashSettings()):
        p = HashParity(settings)
        p.check(Stored([low(x) for x in d[:2]], None, tokens[:8], BS, extra_keys=[["t"], None]))
        p.check(Stored([low(x) for x in d[2:]], low(d[1]), tokens[8:], BS,
                       extra_keys=[None, None]))  # a later store: its parent was verified
        assert verdict(p) == (4, 0, {})
    assert "tagged (vLLM >= 0.31), detected from the stream" in p.rules_line()
    told = HashParity(HashSettings(vllm_version="0.30"))  # the untagged rule: these differ
    told.check(Stored([low(x) for x in d[:2]], None, tokens[:8], BS, extra_keys=[["t"], None]))
    assert verdict(told) == (0, 1, {PARENT_DIFFERS: 1})
    told.check(Stored([low(x) for x in d[2:]], low(d[1]), tokens[8:], BS))
    assert told.unverifiable == {PARENT_DIFFERS: 3}  # not "history not seen": it was seen


def test_a_wrong_tag_differs_once_the_form_is_known_and_is_unverifiable_before():
    tokens = list(range(8))
    good = chain(tokens[:4], [(("cache_salt", "a"),)])
    wrong = chain(tokens[4:], [(("salt", "b"),)])
    p = HashParity(HashSettings())
    p.check(Stored([low(wrong[0])], None, tokens[4:], BS, extra_keys=[["b"]]))
    assert verdict(p) == (0, 0, {UNKNOWN_FORM: 1})  # nothing told the form yet
    p.check(Stored([low(good[0])], None, tokens[:4], BS, extra_keys=[["a"]]))
    p.check(Stored([low(wrong[0])], None, tokens[4:], BS, extra_keys=[["b"]]))
    assert verdict(p) == (1, 1, {UNKNOWN_FORM: 1})
    assert "mismatch: published" in "\n".join(p.lines())


def test_lora_mm_embeds_and_lookahead_blocks_of_0_33():
    tokens = list(range(8))
    digest = bytes(range(32))
    keys = [(("lora", "ad", "/a"), ("mm", "img", 2), ("prompt_embeds", digest)),
            (("lora", "ad", "/a"),)]
    ahead = [[8, 9], [10, 11]]
    d = chain(tokens, [(k, *a) for k, a in zip(keys, ahead, strict=True)])
    event = Stored([low(x) for x in d], None, tokens, BS, lora_name="ad",
                   extra_keys=[["ad", ["img", 2], digest], ["ad"]], lookahead=ahead)
    p = HashParity(HashSettings(vllm_version="0.33", lora_paths={"ad": "/a"}))
    p.check(event)
    assert verdict(p) == (2, 0, {})
    no_path = HashParity(HashSettings(vllm_version="0.33"))
    no_path.check(event)
    no_path.check(Stored([7], low(d[1]), list(range(4)), BS, lora_name="ad", extra_keys=[["ad"]]))
    assert verdict(no_path) == (0, 0, {LORA_PATH: 3})  # the child carries the reason


def test_what_an_old_release_cannot_tell():
    tokens = list(range(4))
    p = HashParity(HashSettings(vllm_version="0.10.1"))
    p.check(Stored([5], None, tokens, BS))
    assert verdict(p) == (0, 0, {INT_DIGESTS: 1})
    p = HashParity(HashSettings(vllm_version="0.20"))  # no PYTHONHASHSEED: random NONE_HASH
    p.check(Stored([low(chain(tokens, [None])[0])], None, tokens, BS))
    assert p.settings.seed is None and verdict(p) == (0, 0, {"NONE_HASH unknown (random seed)": 1})
    p = HashParity(HashSettings(vllm_version="0.20", seed=SEED))
    p.check(Stored([low(chain(tokens, [None])[0])], None, tokens, BS))
    assert p.matched == 1 and "extra keys hashed as published (untagged)" in p.rules_line()
    p = HashParity(HashSettings(vllm_version="0.15", seed=SEED))  # keys not yet published
    p.check(Stored([1], None, tokens, BS, lora_name="ad"))
    assert verdict(p) == (0, 0, {LORA_NOT_PUBLISHED: 1})
    newer = HashParity(HashSettings(vllm_version="0.40.1"))
    assert newer.tagged is None and "newer than the rules known here" in newer.rules_line()


def test_lora_path_values():
    assert lora_paths(["a=/x", "b=/y=z", "a=/x"]) == {"a": "/x", "b": "/y=z"}
    for bad, words in ((["a"], "give NAME=PATH"), (["=p"], "give NAME=PATH"),
                       (["a="], "give NAME=PATH"), (["a=/x", "a=/y"], "different paths")):
        with pytest.raises(ValueError, match=words):
            lora_paths(bad)


def test_a_salted_vllm_chain_is_shown_under_its_salt_digest_and_children_inherit_it():
    m = Mirror()
    m.apply(Batch(0.0, [Stored([1, 2], None, list(range(8)), BS, extra_keys=[["tenant-a"], None]),
                        Stored([3], 2, list(range(4)), BS, extra_keys=[None]),  # continues
                        Stored([4], None, list(range(4)), BS, lora_name="ad",
                               extra_keys=[["ad", ["img", 0]]]),
                        Stored([5], 77, list(range(4)), BS),  # an orphan: salt unknown
                        Stored([6], None, [], BS, cache_salt="tenant-a")]))  # SGLang's field
    salt = m.salt_digest("tenant-a")
    assert {h: m.blocks[(0, 0, "GPU", h)][3] for h in range(1, 7)} == {
        1: (None, salt), 2: (None, salt), 3: (None, salt), 4: ("ad", None), 5: (None, None),
        6: (None, salt)}
    summary = m.summary()
    assert f"identity lora=none salt=#{salt[:8]}: 4 blocks" in summary
    assert "identity lora=ad salt=none: 1 blocks" in summary and "tenant-a" not in summary
    assert Mirror().salt_digest("tenant-a") != salt  # a key per mirror: digests group, only
