"""Engine greedy tokens against transformers on the same saved weights."""

from __future__ import annotations

import math
import random
import tempfile
from pathlib import Path

import torch
import transformers

from gpucheck.plan import BLOCK_SIZE, Plan
from gpucheck.report import Report
from gpucheck.sync import check_engine_step, check_sync
from gpucheck.tensors import free_memory
from kvscope.engine import Engine, EngineConfig, SamplingParams


def build_random_llama(folder: Path, plan: Plan, device):
    """A random bf16 Llama (2 layers, ``plan.model`` shapes) saved as a real HF folder."""
    config = transformers.LlamaConfig(**plan.model, num_hidden_layers=2, bos_token_id=1,
                                      eos_token_id=2, tie_word_embeddings=False,
                                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # norms start at 1: make them matter
                p.add_(torch.randn_like(p) * 0.2)
    model = model.to(torch.bfloat16).eval()
    model.save_pretrained(folder)
    return model


def hf_greedy(model, prompt: list[int], steps: int, device):
    """transformers' own forward over the whole sequence at every step (no cache: independent
    of transformers' cache API, which moves between versions). Returns tokens and logits."""
    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.tensor([prompt + tokens], device=device)
            row = model(input_ids=ids).logits[0, -1].float()
            logits.append(row)
            tokens.append(int(row.argmax()))
    return tokens, logits


def _tie_margin(row) -> float:
    """Two units in the last place of bf16 at the top logit: closer logits are a tie."""
    top = max(abs(row.max().item()), 1e-3)
    return 2 * 2.0 ** (math.floor(math.log2(top)) - 7)


def compare_greedy(ours: list[int], ref: list[int], ref_logits) -> tuple[bool, str]:
    """Equal, or first differing at a near-tie of transformers' own logits (bf16 rounding)."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            margin = (ref_logits[i].max() - ref_logits[i][a]).item()
            tie = margin <= _tie_margin(ref_logits[i])
            return tie, f"{'near-tie' if tie else 'DIFFERS'} at token {i} (margin {margin:.3g})"
    return True, "equal"


def check_engine(report: Report, plan: Plan, device, model_folder: str | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        hf = build_random_llama(folder, plan, device)
        rng = random.Random(0)
        vocab = plan.model["vocab_size"]
        prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in plan.prompt_lens]
        # A prompt sharing the first one's first blocks: a prefix-cache hit when run after it.
        shared = prompts[0][: (len(prompts[0]) // 2) // BLOCK_SIZE * BLOCK_SIZE]
        prompts.append(shared + [rng.randrange(3, vocab) for _ in range(7)])
        refs = [hf_greedy(hf, p, plan.max_tokens, device) for p in prompts]
        del hf
        free_memory(device)
        shapes = "Llama-3.1-8B shapes" if plan.model["hidden_size"] == 4096 else "tiny"
        budget = sum(len(p) for p in prompts) + 64
        for label, tokens_per_step in (("one prefill step", budget),
                                       ("chunked prefill + prefix hit", plan.chunk_tokens)):
            if report.out_of_time("engine", label):
                return
            case = f"random Llama ({shapes}, 2 layers, bf16): {label}"
            report.attempt("engine", case, _greedy_row, report, case, folder, prompts, refs, plan,
                           device, tokens_per_step)
        if not report.out_of_time("sync", "forward"):
            report.attempt("sync", "forward", check_sync, report, folder, plan, device)
            free_memory(device)
            report.attempt("sync", "engine decode step", check_engine_step, report, folder,
                           device)
    if model_folder and not report.out_of_time("engine", model_folder):
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            model_folder, dtype=torch.bfloat16).to(device).eval()
        prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(n)]
                   for n in plan.prompt_lens]
        refs = [hf_greedy(hf, p, plan.max_tokens, device) for p in prompts]
        del hf
        case = f"{Path(model_folder).name} bf16"
        report.attempt("engine", case, _greedy_row, report, case, model_folder, prompts, refs,
                       plan, device, plan.chunk_tokens)


def _greedy_row(report, case, folder, prompts, refs, plan, device, tokens_per_step) -> None:
    engine = Engine.from_pretrained(str(folder), EngineConfig(
        device=device.type, dtype="bfloat16", num_blocks=1024, block_size=BLOCK_SIZE,
        max_num_batched_tokens=tokens_per_step))
    outs = engine.generate(prompts, SamplingParams(max_tokens=plan.max_tokens, ignore_eos=True))
    results = [compare_greedy(o.token_ids, r[0], r[1]) for o, r in zip(outs, refs, strict=True)]
    hits = sum(o.num_cached_tokens for o in outs)
    ok = all(r[0] for r in results)
    equal = sum(r[1] == "equal" for r in results)
    value = "; ".join([f"{equal}/{len(results)} equal", f"{hits} prompt tokens cached",
                       *(r[1] for r in results if r[1] != "equal")])
    report.add("engine", case, ok, value, "tokens equal (or a bf16 near-tie)",
               {"per_prompt": [r[1] for r in results], "cached_tokens": hits,
                "steps": engine.num_steps})
    del engine
    free_memory(device)
