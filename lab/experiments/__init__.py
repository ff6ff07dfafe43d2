"""The textbook's KV-cache claims, measured on a real Engine: one module per experiment, each
with its claim, a measurement (progress and cancel through a `Control`), a result table and a
verdict line. `run(name, model)` is the one entry point (the CLI and the panel use it).

Importing this package is torch-free; `run` loads the model and the engine."""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.lab.experiments import (
    block_size,
    capacity,
    fp8,
    kv_formats,
    lengths,
    naive,
    offload,
    prompt_cache,
    warm_prefix,
    warmup,
)
from kvscope.lab.experiments.result import Cancelled, Control, Result

__all__ = ["EXPERIMENTS", "Cancelled", "Control", "Experiment", "Result", "run"]


@dataclass(frozen=True)
class Experiment:
    name: str
    claim: str
    measure: object  # measure(bench, quick) -> Result


EXPERIMENTS = {e.name: e for e in (
    Experiment(naive.NAME, naive.CLAIM, naive.measure),
    Experiment(lengths.PROMPT, lengths.PROMPT_CLAIM, lengths.measure_prompt),
    Experiment(lengths.OUTPUT, lengths.OUTPUT_CLAIM, lengths.measure_output),
    Experiment(warm_prefix.NAME, warm_prefix.CLAIM, warm_prefix.measure),
    Experiment(warmup.NAME, warmup.CLAIM, warmup.measure),
    Experiment(capacity.NAME, capacity.CLAIM, capacity.measure),
    Experiment(fp8.NAME, fp8.CLAIM, fp8.measure),
    Experiment(kv_formats.NAME, kv_formats.CLAIM, kv_formats.measure),
    Experiment(block_size.NAME, block_size.CLAIM, block_size.measure),
    Experiment(offload.NAME, offload.CLAIM, offload.measure),
    Experiment(prompt_cache.NAME, prompt_cache.CLAIM, prompt_cache.measure),
)}


def run(name: str, model: str = "demo", control: Control | None = None, quick: bool = False,
        device: str = "cpu", prompts: str | list[str] | None = None) -> Result:
    """Measure one experiment. Unknown name: ValueError; model errors: the loader's
    ModelLoadError; a cancel: Cancelled."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; one of: {', '.join(EXPERIMENTS)}")
    from kvscope.lab.experiments.bench import Bench

    result = EXPERIMENTS[name].measure(Bench(model, control, device, prompts), quick)
    result.model = model
    return result
