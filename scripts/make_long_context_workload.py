"""Write resources/workloads/long_context.jsonl: what Run demo (F5) plays on `demo-hybrid`.

Long documents (~1,500 tokens of the demo model) read by questions, on a model whose sliding-
window layers hold 128 tokens: while a document is prefilled and answered, the window group's
blocks leave the window and turn cached mid-request, beside the full-attention group's blocks
that stay held. Document 0 is asked again (hits in both groups), its first third early (a hit:
the window's blocks before that point are still cached), and its first half late, after the
pool has filled and evicted the window blocks released earliest: then full attention still has
the half cached but the window group has none of the blocks it needs before it, and the hit
is cut ("why did this miss" names the group). Deterministic: a fixed seed. The times are
wall-clock: at the window's pace (8 steps/s) and anywhere from 3 to 20 steps/s the late
question is cut by the window (checked by tests/engine/test_demo_hybrid.py at one pace).

    .venv/bin/python scripts/make_long_context_workload.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "resources" / "workloads" / "long_context.jsonl"
SUBJECTS = ("The scheduler", "A block table", "The prefix cache", "A decode step", "The pool",
            "A request", "The tokenizer", "A sliding window", "The attention layer", "A prompt")
VERBS = ("keeps", "reuses", "evicts", "copies", "hashes", "reads", "writes", "frees", "counts",
         "shares")
OBJECTS = ("the oldest cached block", "every full block of the prompt", "the newest keys",
           "a chain of block hashes", "the last partial block", "the tokens of one page",
           "a reference count", "the blocks before the window", "one row of the table",
           "the least recently used block")
TAILS = ("before the next step", "when the pool is full", "unless the salt differs",
         "as the documentation says", "for each request in the batch", "while the model decodes",
         "so the hit rate stays high", "after the prefill ends")
NUM_DOCS, LATE_S = 12, 24.0
HEADER = """\
# What Run demo (F5) plays on demo-hybrid (the demo model's weights, a 128-token sliding window
# on layers 0 and 2): 12 documents of ~1,500 tokens, one every 2 s, each read by a question.
# Watch the window free blocks: while a document is prefilled and answered, the sliding-window
# group's blocks (marked in the pool) turn cached as they leave the window; full attention keeps
# all of its blocks. Document 0 is asked again at 1 s and 12 s (hits in both groups: the window
# group needs only its 8 blocks before the hit point) and its first third at 3 s (a hit). At
# 24 s, when the pool has filled and evicted the window blocks released first, its first half
# is asked: full attention has all of it cached, the window group none of the 8 blocks it needs
# before it, so the hit is 0 tokens (Why did this miss? names the group).
# Made by scripts/make_long_context_workload.py (fixed seed).
"""


def document(rng: random.Random, sentences: int) -> str:
    return " ".join(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} "
                    f"{rng.choice(TAILS)}." for _ in range(sentences))


def main(num_docs: int = NUM_DOCS, late_s: float = LATE_S) -> None:
    rng = random.Random(2026)
    docs = [f"Document {i}.\n{document(rng, 62)}" for i in range(num_docs)]
    third, half = docs[0][: len(docs[0]) // 3], docs[0][: len(docs[0]) // 2]
    lines = [{"arrival_s": 0.0, "prompt": docs[0] + "\nQuestion: what does the pool do?",
              "max_tokens": 48},
             {"arrival_s": 1.0, "prompt": docs[0] + "\nQuestion: when is a block freed?",
              "max_tokens": 48},
             {"arrival_s": 3.0, "prompt": third + "\nQuestion: summarise the first part.",
              "max_tokens": 32},
             {"arrival_s": late_s / 2, "prompt": docs[0] + "\nQuestion: what is evicted?",
              "max_tokens": 48}]
    lines += [{"arrival_s": 2.0 * i + 2.0, "prompt": docs[i] + "\nQuestion: summarise it.",
               "max_tokens": 64} for i in range(1, num_docs)]
    lines.append({"arrival_s": late_s, "prompt": half + "\nQuestion: and the first half?",
                  "max_tokens": 32})
    lines.sort(key=lambda line: line["arrival_s"])
    OUT.write_text(HEADER + "".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    print(f"wrote {OUT} ({len(lines)} requests)")


if __name__ == "__main__":
    import sys

    main(*(int(sys.argv[1]), float(sys.argv[2])) if len(sys.argv) > 2 else ())
