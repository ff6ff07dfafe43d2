"""Token sampling: greedy, temperature, top-k, top-p, seeded per request."""

from __future__ import annotations

import torch

from kvscope.engine.config import SEED_LIMIT, SamplingParams


def make_generator(params: SamplingParams, salt: int = 0) -> torch.Generator | None:
    """A request's own random stream (None for greedy). `salt` separates parallel samples."""
    if params.temperature == 0:
        return None
    g = torch.Generator()
    g.manual_seed(((params.seed if params.seed is not None else torch.seed()) + salt) % SEED_LIMIT)
    return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from float32 logits [vocab]."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.float().cpu() / params.temperature
    if params.top_k and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = torch.cumsum(sorted_probs, 0) - sorted_probs >= params.top_p
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
