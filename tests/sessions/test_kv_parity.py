"""Hash parity: recomputing vLLM block hashes from published token ids."""

import hashlib
import pickle

import pytest

from kvscope.sessions.kv_events import Mirror, Stored
from kvscope.sessions.kv_events.parity import HashParity, HashSettings, cbor

BS = 4


def test_cbor_matches_cbor2_canonical_output():
    # Known answers produced by cbor2 6.2.1, dumps(obj, canonical=True) (the encoder vLLM uses)
    obj = (bytes(range(32)), (1, 2, 300, 70000), ("tenant-a",))
    assert cbor(obj).hex() == (
        "835820000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f84010219012c"
        "1a00011170816874656e616e742d61")
    assert hashlib.sha256(cbor("vllm-none-hash")).hexdigest() == (
        "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0")


def vllm_chain(tokens, extra_first=None, seed="vllm-none-hash"):
    """vLLM's hash_block_tokens with sha256 (pickle), written out from its source."""
    def h(obj):
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    parent, out = h(seed), []
    for i in range(len(tokens) // BS):
        parent = h((parent, tuple(tokens[i * BS:(i + 1) * BS]), extra_first if i == 0 else None))
        out.append(parent)
    return out


def as_int(d: bytes) -> int:
    return int.from_bytes(d, "big") & ((1 << 64) - 1)


def test_a_published_chain_matches_and_its_continuation_too():
    tokens = list(range(100, 120))
    d = vllm_chain(tokens)
    p = HashParity(HashSettings())
    p.check(Stored([as_int(x) for x in d[:3]], None, tokens[:12], BS))
    p.check(Stored([as_int(x) for x in d[3:]], as_int(d[2]), tokens[12:], BS))  # a later store
    assert (p.matched, p.mismatched, sum(p.unverifiable.values())) == (5, 0, 0)


def test_a_salted_chain_mismatches_unless_its_extra_keys_are_published():
    tokens = list(range(8))
    d = [as_int(x) for x in vllm_chain(tokens, extra_first=("tenant-a",))]
    plain = HashParity(HashSettings())
    plain.check(Stored(d, None, tokens, BS))
    assert (plain.matched, plain.mismatched) == (0, 1)
    assert plain.unverifiable == {"parent's hash differs": 1}
    assert "recomputed" in plain.lines()[-1]
    told = HashParity(HashSettings())
    told.check(Stored(d, None, tokens, BS, extra_keys=[["tenant-a"], None]))
    assert (told.matched, told.mismatched) == (2, 0)


def test_what_cannot_be_recomputed_is_said_not_guessed():
    tokens = list(range(8))
    d = vllm_chain(tokens)
    p = HashParity(HashSettings())
    p.check(Stored([as_int(d[1])], 12345, tokens[4:], BS))  # parent never seen, 64-bit hashes
    p.check(Stored([as_int(d[0])], None, [], BS))  # no token ids (kvscope's own publisher)
    assert p.matched == p.mismatched == 0 and sum(p.unverifiable.values()) == 2
    p.check(Stored([d[1]], d[0], tokens[4:], BS))  # bytes hashes carry the full parent digest
    assert p.matched == 1
    random_seed = HashParity(HashSettings(seed=None))
    random_seed.check(Stored([as_int(d[0])], None, tokens[:4], BS))
    assert random_seed.unverifiable == {"NONE_HASH unknown (random seed)": 1}
    with pytest.raises(ValueError, match="only sha256, sha256_cbor"):
        HashSettings("xxhash")


def test_the_mirror_reports_parity_in_its_summary():
    tokens = list(range(8))
    d = [as_int(x) for x in vllm_chain(tokens, seed="0")]
    from kvscope.sessions.kv_events.wire import Batch

    m = Mirror(parity=HashParity(HashSettings("sha256", seed="0")))
    m.apply(Batch(0.0, [Stored(d, None, tokens, BS)]))
    assert "hash parity (sha256, seed given): 2 blocks match, 0 differ" in m.summary()
