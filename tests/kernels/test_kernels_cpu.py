"""The C kernels of kernels/cpu.py against torch (and the dense oracle for decode attention)."""

import math

import pytest
import torch
import torch.nn.functional as F
from kv_testutil import build_paged, dense_causal_attention

from kvscope.engine.models.rotary import apply_rope
from kvscope.kernels import cpu, kernel_backend, reference

# float32 dots of a few hundred terms in another summation order.
ATOL = 1e-4


@pytest.fixture(autouse=True)
def _threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_library_builds_here():
    # Every other test here would pass vacuously through the torch fallback without it.
    assert cpu.load() is not None, "no C compiler (cc) found: kvscope's CPU kernels are off"


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 11, 12])
@pytest.mark.parametrize(("n", "k"), [(576, 576), (7, 33), (130, 1536), (64, 16)])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_matches_torch(rows, n, k, threads):
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w, b = (torch.randn(s, generator=gen) for s in ((rows, k), (n, k), (n,)))
    for bias in (None, b):
        got = cpu.linear(x, w, bias)
        assert got is not None and got.shape == (rows, n)
        torch.testing.assert_close(got, F.linear(x, w, bias), atol=ATOL, rtol=1e-5)


def test_linear_declines_what_it_does_not_handle():
    w = torch.randn(8, 16)
    assert cpu.linear(torch.randn(cpu.LINEAR_MAX_ROWS + 1, 16), w) is None  # MKL's GEMM
    assert cpu.linear(torch.randn(2, 16, dtype=torch.bfloat16), w.bfloat16()) is None
    assert cpu.linear(torch.randn(16, 2).T, w) is None  # not contiguous
    assert cpu.linear(torch.randn(2, 16), torch.randn(16, 8).T) is None
    with torch.enable_grad():
        assert cpu.linear(torch.randn(2, 16), w.requires_grad_()) is None


def test_rms_norm_rope_and_silu_match_torch():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 576, generator=gen) * 3, torch.randn(576, generator=gen)
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-5), want, atol=1e-5, rtol=1e-5)

    q = torch.randn(7, 9, 64, generator=gen)
    cos, sin = torch.randn(2, 7, 1, 64, generator=gen)
    rotated = q.clone()
    assert cpu.rope_(rotated, cos, sin)
    torch.testing.assert_close(rotated, apply_rope(q, cos, sin), atol=1e-5, rtol=1e-5)
    assert not cpu.rope_(q.half(), cos.half(), sin.half())

    g, u = torch.randn(2, 3, 100, generator=gen) * 4
    torch.testing.assert_close(cpu.silu_mul(g, u), F.silu(g) * u, atol=1e-6, rtol=1e-5)
    g = torch.linspace(-120, 120, 2001)  # the vector exp's clamps and its scalar tail
    torch.testing.assert_close(cpu.silu_mul(g, g), F.silu(g) * g, atol=1e-6, rtol=2e-6)


def test_store_writes_the_same_slots_as_the_reference():
    gen = torch.Generator().manual_seed(2)
    caches = torch.randn(2, 6, 4, 2, 8, generator=gen)
    key, value = torch.randn(2, 5, 2, 8, generator=gen)
    slots = torch.tensor([3, -1, 23, 0, 9])
    want = caches.clone()
    reference.store_kv(key, value, want[0], want[1], slots)
    got = caches.clone()
    assert cpu.store_kv(key, value, got[0], got[1], slots)
    assert torch.equal(got, want)
    with pytest.raises(IndexError, match="slot out of range"):
        cpu.store_kv(key, value, got[0], got[1], torch.tensor([3, -1, 24, 0, 9]))
    assert torch.equal(got, want)  # nothing written


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("head_dim", [64, 32, 88])  # 64-column, 16-column and scalar steps
def test_decode_attention_matches_dense(group, threads, head_dim):
    torch.set_num_threads(threads)
    lengths, kv_heads, block_size = [1, 17, 64, 130], 3, 16
    k_cache, v_cache, tables, dense = build_paged(lengths, kv_heads, head_dim, block_size,
                                                  torch.float32, seed=group)
    q = torch.randn(len(lengths), kv_heads * group, head_dim)
    lens = torch.tensor(lengths, dtype=torch.int32)
    scale = 1 / math.sqrt(head_dim)
    got = cpu.decode_attention(q, k_cache, v_cache, tables, lens, scale, max(lengths))
    for b, (k, v) in enumerate(dense):
        want = dense_causal_attention(q[b:b + 1], k, v, scale)[0]
        torch.testing.assert_close(got[b], want, atol=2e-5, rtol=1e-5)


def test_decode_attention_checks_block_ids():
    k_cache, v_cache, tables, _ = build_paged([20], 1, 16, 8, torch.float32)
    q, lens = torch.randn(1, 2, 16), torch.tensor([20], dtype=torch.int32)
    tables[0, 1] = k_cache.shape[0]
    with pytest.raises(IndexError, match="outside the pool"):
        cpu.decode_attention(q, k_cache, v_cache, tables, lens, 0.25, 20)
    with pytest.raises(IndexError, match="too short"):
        cpu.decode_attention(q, k_cache, v_cache, tables[:, :2], lens.fill_(40), 0.25, 40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("mask_entries", [cpu.MASK_ENTRIES, 200])
def test_prefill_attention_matches_the_reference_and_the_dense_oracle(dtype, mask_entries,
                                                                      monkeypatch):
    """Whole prompts (the causal flag), prefix hits and chunked prefills (a mask), GQA, and a
    mask budget small enough to split a hit's query rows into several calls."""
    monkeypatch.setattr(cpu, "MASK_ENTRIES", mask_entries)
    lengths, new = [1, 40, 37, 90, 5], [1, 40, 12, 61, 2]  # context and new tokens per sequence
    k_cache, v_cache, tables, dense = build_paged(lengths, 2, 16, 8, dtype, k_scale=0.5, seed=3)
    q_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    q = torch.randn(sum(new), 6, 16).to(q_dtype)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    backend = kernel_backend(None, "cpu")
    got = backend.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.25, 0.5, 1.0,
                                          max(new))
    want = reference.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.25, 0.5,
                                             1.0)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype != torch.bfloat16 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got, want, **tol)
    for b, (k, v) in enumerate(dense):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        torch.testing.assert_close(got[rows].float(),
                                   dense_causal_attention(q[rows], k, v, 0.25).to(q_dtype).float(),
                                   **tol)


def test_cpu_backend_falls_back_to_the_reference_for_a_16_bit_query():
    """Other caches are read in C (test_kernels_cpu_formats.py); a bfloat16 model's query is
    not: the reference's own result."""
    backend = kernel_backend(None, "cpu")
    assert backend.name == "cpu"
    k_cache, v_cache, tables, _ = build_paged([9, 30], 2, 16, 8, torch.bfloat16)
    q = torch.randn(2, 4, 16).to(torch.bfloat16)
    lens = torch.tensor([9, 30], dtype=torch.int32)
    got = backend.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, 1.0, 1.0, 30)
    want = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, 1.0, 1.0, 30)
    assert torch.equal(got, want)


def test_hugepage_weights_keeps_values_and_ties():
    emb = torch.nn.Embedding(50, 8)
    head = torch.nn.Linear(8, 50, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head, "mlp": torch.nn.Linear(8, 3)})
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    moved = cpu.hugepage_weights(model)
    assert moved >= sum(p.numel() * 4 for p in before.values())
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) and p.data_ptr() % 64 == 0
    assert model["head"].weight is model["emb"].weight
    x = torch.randn(3, 8)
    torch.testing.assert_close(model["mlp"](x), F.linear(x, before["mlp.weight"],
                                                       before["mlp.bias"]))


def test_switch_off_gives_plain_torch(monkeypatch):
    monkeypatch.setenv("KVSCOPE_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu, "_lib", False)  # not loaded yet in this "process"
    x, w = torch.randn(1, 16), torch.randn(8, 16)
    assert cpu.linear(x, w) is None and cpu.silu_mul(x, x) is None
    model = torch.nn.Linear(16, 8)
    ptr = model.weight.data_ptr()
    assert cpu.hugepage_weights(model) == 0 and model.weight.data_ptr() == ptr


# oneDNN's blocked GEMM sums the K terms in another order than MKL: float32 dots of up to 1536
# terms of unit-scale values (results ~40) agree to a few 1e-5.
PACKED_ATOL, PACKED_RTOL = 2e-4, 1e-5


def _prepacked(n: int, k: int, bias: bool, seed: int = 0):
    from kvscope.engine.models.llama import Linear

    gen = torch.Generator().manual_seed(seed)
    module = Linear(k, n, bias=bias)
    with torch.no_grad():
        module.weight.copy_(torch.randn(n, k, generator=gen))
        if bias:
            module.bias.copy_(torch.randn(n, generator=gen))
    module.prepack = True
    return module, gen


@pytest.mark.parametrize("rows", [cpu.LINEAR_MAX_ROWS + 1, 64, 757])
@pytest.mark.parametrize(("n", "k"), [(576, 576), (192, 576), (1536, 576), (576, 1536), (7, 33)])
def test_packed_linear_matches_f_linear_and_is_taken(rows, n, k):
    torch.set_num_threads(1)
    for bias in (False, True):
        module, gen = _prepacked(n, k, bias, seed=rows + n + k)
        x = torch.randn(rows, k, generator=gen)
        with torch.inference_mode():
            got = module.forward(x)
        # taken: the reordered copy exists now, as large as the weight
        assert cpu.packed_bytes(module) == n * k * 4
        torch.testing.assert_close(got, F.linear(x, module.weight, module.bias),
                                   atol=PACKED_ATOL, rtol=PACKED_RTOL)


def test_packed_linear_packs_once_and_follows_weight_changes():
    module, gen = _prepacked(64, 32, bias=True)
    x = torch.randn(20, 32, generator=gen)
    with torch.no_grad():
        module.forward(x)
        first = module.__dict__[cpu._PACK_ATTR][1]
        module.forward(x)
        assert module.__dict__[cpu._PACK_ATTR][1] is first  # not repacked per call
        module.weight.mul_(2)  # in place: a new version, so a new copy
        torch.testing.assert_close(module.forward(x), F.linear(x, module.weight, module.bias),
                                   atol=PACKED_ATOL, rtol=PACKED_RTOL)
        assert module.__dict__[cpu._PACK_ATTR][1] is not first
    cpu.drop_packed(module)
    assert cpu.packed_bytes(module) == 0


def test_packed_linear_declines_what_it_does_not_handle(monkeypatch):
    module, gen = _prepacked(64, 32, bias=False)
    with torch.no_grad():
        assert cpu.packed_linear(module, torch.randn(cpu.LINEAR_MAX_ROWS, 32)) is None
        assert cpu.packed_linear(module, torch.randn(20, 32, dtype=torch.bfloat16)) is None
        assert cpu.packed_linear(module, torch.randn(32, 20).T) is None  # not contiguous
    with torch.enable_grad():
        assert cpu.packed_linear(module, torch.randn(20, 32)) is None  # weight requires grad
    monkeypatch.setenv("KVSCOPE_CPU_KERNELS", "0")  # the plain-torch engine
    with torch.no_grad():
        assert cpu.packed_linear(module, torch.randn(20, 32)) is None
    monkeypatch.delenv("KVSCOPE_CPU_KERNELS")
    monkeypatch.setattr(cpu, "_packing", False)  # a torch build without the oneDNN ops
    x = torch.randn(20, 32)
    with torch.no_grad():
        assert cpu.packed_linear(module, x) is None
        torch.testing.assert_close(module.forward(x), F.linear(x, module.weight))  # F.linear
    monkeypatch.setattr(cpu, "_packing", None)
    module.prepack = False
    with torch.no_grad():
        module.forward(x)
    assert cpu.packed_bytes(module) == 0
