"""Drives a real Engine for the experiments: the model loaded once, engines made per setting,
requests run to completion while the step stream collects each step's record, progress and
cancel checked every step. Uses the public API and the step stream only."""

from __future__ import annotations

import random

from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.metrics import StepRecord
from kvscope.engine.outputs import RequestOutput
from kvscope.engine.stream import StepQueue
from kvscope.lab.experiments.result import Control

FIRST_TOKEN = 3  # below: special tokens in most vocabularies (bos, eos, pad)


class Bench:
    def __init__(self, model: str = "demo", control: Control | None = None, device: str = "cpu",
                 prompts: str | list[str] | None = None):
        """`prompts`: a workload file or prompt texts, for the experiments that measure on a
        prompt set (`prompt_set`); None: the built-in passages."""
        from kvscope.engine.models.load import load_model

        self.model, self.device, self.prompts = model, device, prompts
        self.control = control or Control()
        self.loaded = load_model(model, device=device)
        self.done, self.total = 0, 1

    @property
    def model_config(self):
        return self.loaded.config

    def engine(self, **config):
        from kvscope.engine.engine import Engine

        config.setdefault("device", self.device)
        config.setdefault("num_blocks", 512)
        return Engine(self.loaded, EngineConfig(**config))

    def prompt(self, n: int, seed: int) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(FIRST_TOKEN, self.loaded.config.vocab_size) for _ in range(n)]

    def plan(self, total: int) -> None:
        """The number of runs ahead, for the progress bar."""
        self.done, self.total = 0, max(1, total)

    def run(self, engine, prompts: list[list[int]], max_tokens: int
            ) -> tuple[list[RequestOutput], list[StepRecord]]:
        """All prompts at once, to completion: (final outputs in prompt order, step records)."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        queue = StepQueue()
        engine.subscribe(queue)
        try:
            ids = [engine.add_request(p, params) for p in prompts]
            final: dict[int, RequestOutput] = {}
            while engine.has_unfinished():
                self.control.tick(self.done, self.total, f"{self.model}: step")
                final.update((o.request_id, o) for o in engine.step() if o.finished)
        finally:
            engine.unsubscribe(queue)
        self.advance()
        return [final[i] for i in ids], [u.record for u in queue.drain()]

    def advance(self) -> None:
        """One of the planned runs is done."""
        self.done += 1
        self.control.tick(self.done, self.total)

    def prompt_set(self, count: int, max_tokens: int) -> list[list[int]]:
        from kvscope.lab.experiments.prompt_set import prompt_ids

        return prompt_ids(self.loaded.tokenizer, self.prompts, count, max_tokens)

    def kv_bytes_per_token(self, kv_cache_dtype: str) -> int:
        """What the engine's cache stores per token in this format (scales included)."""
        from kvscope.engine.model_runner import ModelRunner

        return ModelRunner(self.loaded, 1, 16, kv_cache_dtype, self.device).kv_bytes_per_token

    def forced(self, kv_cache_dtype: str, prompts: list[list[int]],
               continuations: list[list[int]], sides: str = "kv"):
        """Teacher-forced logits of every prompt on a model runner of its own with this KV
        format (the engine hands back tokens, not logits): kv_sides.forced."""
        from kvscope.lab.experiments.kv_sides import forced

        return forced(self.loaded, self.device, kv_cache_dtype, prompts, continuations, sides)

    def one(self, engine, prompt: list[int], max_tokens: int) -> RequestOutput:
        return self.run(engine, [prompt], max_tokens)[0][0]
