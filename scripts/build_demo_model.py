#!/usr/bin/env python
"""Build the built-in demo model in ``resources/demo/`` from scratch.

Everything is produced locally with a fixed seed and no download:

1. a byte-level BPE tokenizer (``tokenizers`` library, vocab 2048, special
   tokens ``<|bos|>``, ``<|eos|>``, ``<|pad|>``), saved so that
   ``transformers.AutoTokenizer.from_pretrained(out)`` loads it offline;
2. a tiny Llama-architecture model (GQA: 8 query heads, 4 KV heads) trained
   briefly on one CPU thread on the English help texts that ship with Python
   (``pydoc_data.topics``);
3. ``model.safetensors`` (bfloat16), ``config.json``, ``generation_config.json``
   and a model card ``README.md`` with the training record.

The result is a toy for demonstrating the paged KV cache, not a useful
language model.

Rebuild with::

    .venv/bin/python scripts/build_demo_model.py
"""

from __future__ import annotations

import os

# One core only: other processes share this machine. Must be set before torch
# is imported so the OpenMP/MKL pools are created with a single thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "resources" / "demo"

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, PAD]  # ids 0, 1, 2

# Model shapes. intermediate_size is 512 rather than the Llama-style 688 to keep
# the bf16 checkpoint under 6 MB and leave more steps in the CPU time budget.
MODEL_SHAPES = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)

# Files this script writes into --out (anything else there is left alone).
PRODUCED_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "README.md",
]


def log(msg: str) -> None:
    print(msg, flush=True)


def load_corpus() -> list[str]:
    """The English help texts shipped with Python, in a fixed (sorted) order."""
    from pydoc_data.topics import topics

    return [topics[k].strip() for k in sorted(topics) if topics[k].strip()]


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Like Llama: encoding a prompt prepends <|bos|>.
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    return tok


def save_tokenizer(tok: Tokenizer, out: Path, model_max_length: int) -> None:
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    wrapped.save_pretrained(str(out))
    # Make the config explicit and self-describing, whatever the transformers
    # version wrote: a generic fast tokenizer backed by tokenizer.json.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        add_bos_token=True,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
        # The generic name (an alias of TokenizersBackend in transformers 5)
        # also loads with transformers 4.
        tokenizer_class="PreTrainedTokenizerFast",
    )
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n"
    )


def token_stream(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """<|bos|> doc <|eos|> for every document, concatenated."""
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(bos_id)
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def lr_at(step: int, steps: int, peak: float, warmup: int, floor_frac: float = 0.1) -> float:
    """Linear warmup, then cosine decay to floor_frac * peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (floor_frac + (1 - floor_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def eval_loss(
    model, data: torch.Tensor, seq_len: int, max_batches: int = 8, batch: int = 16
) -> float:
    model.eval()
    n = (len(data) - 1) // seq_len
    starts = [i * seq_len for i in range(n)][: max_batches * batch]
    losses = []
    for i in range(0, len(starts), batch):
        x = torch.stack([data[s : s + seq_len] for s in starts[i : i + batch]])
        y = torch.stack([data[s + 1 : s + seq_len + 1] for s in starts[i : i + batch]])
        logits = model(input_ids=x).logits
        losses.append(
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), y.reshape(-1)
            ).item()
        )
    model.train()
    return sum(losses) / max(1, len(losses))


@torch.no_grad()
def sample(
    model, hf_tok, prompt: str, max_new_tokens: int, temperature: float = 0.0, seed: int = 0
) -> str:
    model.eval()
    ids = hf_tok(prompt, return_tensors="pt").input_ids
    kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=hf_tok.pad_token_id)
    if temperature > 0:
        torch.manual_seed(seed)
        kwargs.update(do_sample=True, temperature=temperature, top_k=50)
    else:
        kwargs.update(do_sample=False)
    out = model.generate(ids, **kwargs)
    return hf_tok.decode(out[0], skip_special_tokens=True)


def write_model_card(out: Path, rec: dict) -> None:
    s = rec["shapes"]
    nbytes = rec["file_bytes"]
    n_kv = s["num_key_value_heads"]
    group = s["num_attention_heads"] // n_kv
    card = f"""# kvscope demo model

A **toy** Llama-architecture causal language model built from scratch by
`scripts/build_demo_model.py`, so that kvscope starts offline in seconds with
a real model to run through the paged KV cache. It exists to demonstrate the
KV cache (GQA grouping, paging, eviction); it is **not a useful language
model**. It writes English-looking words and Python-documentation phrases,
mostly without meaning.

## Rebuild

```
.venv/bin/python scripts/build_demo_model.py
```

(`--steps N` changes the training length, `--out DIR` the output folder; see
`--help`.) Everything is generated locally with seed {rec["seed"]}; nothing is
downloaded. Training runs on one CPU thread.

## Size

| | |
|---|---|
| parameters | {rec["n_params"]:,} (embedding tied with the LM head) |
| `model.safetensors` | {nbytes:,} bytes ({nbytes / 2**20:.2f} MiB), bfloat16 |

## Shapes (`config.json`)

| field | value |
|---|---|
| architecture | `LlamaForCausalLM` |
| vocab_size | {s["vocab_size"]} |
| hidden_size | {s["hidden_size"]} |
| num_hidden_layers | {s["num_hidden_layers"]} |
| num_attention_heads | {s["num_attention_heads"]} |
| num_key_value_heads | {n_kv} (GQA, {group} query heads per KV head) |
| head_dim | {s["head_dim"]} |
| intermediate_size | {s["intermediate_size"]} (SwiGLU MLP) |
| max_position_embeddings | {s["max_position_embeddings"]} |
| rope_theta | {s["rope_theta"]} |
| rms_norm_eps | {s["rms_norm_eps"]} |
| tie_word_embeddings | {str(s["tie_word_embeddings"]).lower()} |
| dtype | bfloat16 |

KV cache per token: {s["num_hidden_layers"]} layers x 2 (K, V) x {n_kv} KV heads x
{s["head_dim"]} x 2 bytes = {rec["kv_bytes_per_token"]:,} bytes in bfloat16.

## Tokenizer

Byte-level BPE trained with the `tokenizers` library on the same corpus:
ByteLevel pre-tokenizer (no prefix space) and ByteLevel decoder, vocabulary
{rec["vocab_size"]}, special tokens `<|bos|>` (id {rec["bos_id"]}), `<|eos|>` (id {rec["eos_id"]}),
`<|pad|>` (id {rec["pad_id"]}). Encoding prepends `<|bos|>`. Loads with
`transformers.AutoTokenizer.from_pretrained("resources/demo")`; any text
round-trips exactly (`decode(encode(text), skip_special_tokens=True) == text`).

## Training

- Data: the English help texts that ship with Python,
  `pydoc_data.topics.topics` ({rec["n_docs"]} documents, {rec["n_chars"]:,} characters,
  {rec["n_tokens"]:,} tokens) from Python {rec["python_version"]}. Each document is wrapped as
  `<|bos|> text <|eos|>` and the documents are concatenated; the last
  {rec["val_frac"]:.0%} of the token stream is held out for evaluation.
- Objective: next-token prediction on random windows of {rec["seq_len"]} tokens,
  batch {rec["batch_size"]} ({rec["seq_len"] * rec["batch_size"]:,} tokens per step).
- Optimiser: AdamW (betas 0.9/0.95, weight decay {rec["weight_decay"]}), peak learning rate
  {rec["lr"]}, {rec["warmup"]} warmup steps then cosine decay to 10 %, gradient clipping 1.0,
  float32 weights during training, saved as bfloat16.
- Steps: {rec["steps_done"]} (of {rec["steps"]} planned){rec["stop_note"]}, about
  {rec["epochs"]:.1f} passes over the training tokens.
- Final training loss: **{rec["final_train_loss"]:.3f}** (mean of the last
  {rec["loss_window"]} steps; last step {rec["last_step_loss"]:.3f}). Held-out loss
  (last {rec["val_frac"]:.0%} of the token stream): {rec["val_loss"]:.3f}.
- Seed: {rec["seed"]} (Python, torch, data sampling).
- Training wall time: {rec["train_seconds"]:.0f} s on one CPU thread ({rec["cpu"]}),
  torch {rec["torch_version"]}, transformers {rec["transformers_version"]},
  tokenizers {rec["tokenizers_version"]}.
  Whole build: {rec["total_seconds"]:.0f} s.

## Samples

Greedy, {rec["sample_tokens"]} new tokens:

"""
    for prompt, text in rec["greedy_samples"]:
        card += f"- `{prompt!r}` -> {json.dumps(text, ensure_ascii=False)}\n"
    card += f"\nTemperature {rec['temperature']}, top-k 50, seed {rec['seed']}:\n\n"
    for prompt, text in rec["temp_samples"]:
        card += f"- `{prompt!r}` -> {json.dumps(text, ensure_ascii=False)}\n"
    (out / "README.md").write_text(card)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"output folder (default: {DEFAULT_OUT.relative_to(REPO_ROOT)})",
    )
    p.add_argument("--steps", type=int, default=330, help="training steps (default: 330)")
    p.add_argument(
        "--seq-len", type=int, default=256, help="training window in tokens (default: 256)"
    )
    p.add_argument("--batch-size", type=int, default=16, help="windows per step (default: 16)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default: 2e-3)")
    p.add_argument("--warmup", type=int, default=30, help="warmup steps (default: 30)")
    p.add_argument("--seed", type=int, default=1234, help="seed (default: 1234)")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=11.0,
        help="stop training early once this much training wall time has passed (default: 11)",
    )
    p.add_argument(
        "--log-every", type=int, default=10, help="print the loss every N steps (default: 10)"
    )
    args = p.parse_args(argv)

    t_start = time.time()
    torch.set_num_threads(1)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    import tokenizers
    import transformers
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for name in PRODUCED_FILES:
        (out / name).unlink(missing_ok=True)

    # ---- data + tokenizer -------------------------------------------------
    texts = load_corpus()
    n_chars = sum(len(t) for t in texts)
    log(f"corpus: {len(texts)} documents, {n_chars:,} characters (pydoc_data.topics)")
    tok = train_tokenizer(texts, MODEL_SHAPES["vocab_size"])
    assert tok.get_vocab_size() == MODEL_SHAPES["vocab_size"], tok.get_vocab_size()
    bos_id, eos_id, pad_id = (tok.token_to_id(t) for t in SPECIAL_TOKENS)
    save_tokenizer(tok, out, MODEL_SHAPES["max_position_embeddings"])
    log(f"tokenizer: vocab {tok.get_vocab_size()}, bos={bos_id} eos={eos_id} pad={pad_id}")

    data = token_stream(tok, texts)
    val_frac = 0.05
    n_val = int(len(data) * val_frac)
    train_data, val_data = data[:-n_val], data[-n_val:]
    log(f"tokens: {len(data):,} ({len(train_data):,} train, {len(val_data):,} held out)")

    # ---- model ------------------------------------------------------------
    config = LlamaConfig(
        **MODEL_SHAPES,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        initializer_range=0.02,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: LlamaForCausalLM, {n_params:,} parameters")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    weight_decay = 0.1
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed)
    T, B = args.seq_len, args.batch_size
    max_start = len(train_data) - T - 1

    # ---- train ------------------------------------------------------------
    losses: list[float] = []
    t_train = time.time()
    stop_note = ""
    steps_done = 0
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, max_start + 1, (B,), generator=gen)
        x = torch.stack([train_data[s : s + T] for s in starts.tolist()])
        y = torch.stack([train_data[s + 1 : s + T + 1] for s in starts.tolist()])
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        steps_done = step + 1
        elapsed = time.time() - t_train
        if step % args.log_every == 0 or steps_done == args.steps:
            msg = f"step {steps_done:4d}/{args.steps}  loss {losses[-1]:.4f}  lr {lr:.2e}"
            log(f"{msg}  {elapsed:.0f}s")
        if elapsed > args.max_minutes * 60 and steps_done < args.steps:
            stop_note = f", stopped early by the {args.max_minutes:g}-minute wall-time limit"
            log(f"wall-time limit reached after {steps_done} steps; stopping")
            break
    train_seconds = time.time() - t_train
    loss_window = min(20, len(losses))
    final_train_loss = sum(losses[-loss_window:]) / loss_window
    val_loss = eval_loss(model, val_data, T)
    log(f"final train loss {final_train_loss:.4f} (mean of last {loss_window} steps)")
    log(f"held-out loss {val_loss:.4f}")
    log(f"training wall time {train_seconds:.1f}s")

    # ---- save -------------------------------------------------------------
    model = model.to(torch.bfloat16)
    model.config.architectures = ["LlamaForCausalLM"]
    model.generation_config.bos_token_id = bos_id
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "model.safetensors").chmod(0o644)
    # Spell the dtype under both names (transformers 5 writes "dtype", older
    # readers look for "torch_dtype").
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = "bfloat16"
    cfg["torch_dtype"] = "bfloat16"
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["rope_theta"] = MODEL_SHAPES["rope_theta"]  # also under rope_parameters
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    file_bytes = (out / "model.safetensors").stat().st_size
    log(f"saved {out}/model.safetensors ({file_bytes:,} bytes)")

    # ---- samples from the saved folder (what the app will load) ----------
    hf_tok = AutoTokenizer.from_pretrained(str(out))
    reloaded = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    sample_tokens, temperature = 30, 0.8
    prompts = ["The", "A function", "In Python,"]
    greedy = [(pr, sample(reloaded, hf_tok, pr, sample_tokens)) for pr in prompts]
    temp = [
        (pr, sample(reloaded, hf_tok, pr, sample_tokens, temperature, args.seed)) for pr in prompts
    ]
    for pr, text in greedy:
        log(f"greedy  {pr!r}: {text!r}")
    for pr, text in temp:
        log(f"T={temperature} {pr!r}: {text!r}")

    s = MODEL_SHAPES
    rec = dict(
        shapes=s,
        seed=args.seed,
        n_params=n_params,
        file_bytes=file_bytes,
        kv_bytes_per_token=s["num_hidden_layers"]
        * 2
        * s["num_key_value_heads"]
        * s["head_dim"]
        * 2,
        vocab_size=tok.get_vocab_size(),
        bos_id=bos_id,
        eos_id=eos_id,
        pad_id=pad_id,
        n_docs=len(texts),
        n_chars=n_chars,
        n_tokens=len(data),
        python_version=platform.python_version(),
        val_frac=val_frac,
        seq_len=T,
        batch_size=B,
        weight_decay=weight_decay,
        lr=args.lr,
        warmup=args.warmup,
        steps=args.steps,
        steps_done=steps_done,
        stop_note=stop_note,
        epochs=steps_done * B * T / len(train_data),
        final_train_loss=final_train_loss,
        loss_window=loss_window,
        last_step_loss=losses[-1],
        val_loss=val_loss,
        train_seconds=train_seconds,
        total_seconds=time.time() - t_start,
        cpu=platform.processor() or platform.machine(),
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        tokenizers_version=tokenizers.__version__,
        sample_tokens=sample_tokens,
        temperature=temperature,
        greedy_samples=greedy,
        temp_samples=temp,
    )
    write_model_card(out, rec)
    log(f"wrote {out}/README.md; total build time {rec['total_seconds']:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
