"""The kv-formats experiment's arithmetic against hand-computed values, and its prompt sources:
the built-in passages, a workload file, a session (only one recorded with its text)."""

import math

import numpy as np
import pytest
import torch

from kvscope.lab.experiments import kv_formats
from kvscope.lab.experiments.prompt_set import BUILTIN, prompt_ids


def test_divergence_is_kl_of_the_reference_against_the_other_in_nats():
    p, q = [0.5, 0.25, 0.25], [0.25, 0.5, 0.25]
    a = torch.tensor([p, p]).log()
    b = torch.tensor([q, p]).log()
    kld, top1 = kv_formats.divergence([a], [b])
    want = sum(x * math.log(x / y) for x, y in zip(p, q, strict=True))  # 0.1733
    assert kld == pytest.approx([want, 0.0], abs=1e-6)
    assert top1 == [False, True]


def test_percentile_matches_numpy_linear():
    values = [float(x) for x in np.random.default_rng(0).exponential(size=537)]
    for q in (50, 99, 99.9, 100):
        assert kv_formats.percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_first_divergence_is_the_earliest_over_prompts():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert kv_formats.first_divergence(ref, [[1, 2, 9, 4], [5, 0, 7, 8]]) == 1
    assert kv_formats.first_divergence(ref, [list(r) for r in ref]) == "-"


class Words:
    """A tokenizer of whitespace words (ids from a running vocabulary)."""

    def __init__(self):
        self.vocab = {}

    def encode(self, text):
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]


def test_builtin_prompts_are_cut_and_counted():
    ids = prompt_ids(Words(), None, 3, 10)
    assert len(ids) == 3 and all(len(x) == 10 for x in ids)
    assert len(prompt_ids(Words(), None, 100, 10)) == len(BUILTIN)


def test_workload_prompts_take_text_and_ids(tmp_path):
    f = tmp_path / "w.jsonl"
    f.write_text('{"define_prefix": "sys", "text": "be brief "}\n'
                 '{"prefix": "sys", "prompt": "what is a list"}\n'
                 '{"prompt_ids": [7, 8, 9]}\n{"prompt": "x"}\n')
    words = Words()
    ids = prompt_ids(words, f, 8, 64)
    assert ids == [[0, 1, 2, 3, 4, 5], [7, 8, 9]]  # the 1-token prompt is left out


def test_a_session_without_its_text_is_refused_with_the_way_to_record_it(tmp_path):
    from kvscope.engine import Engine, EngineConfig, SamplingParams
    from kvscope.engine.models.load import load_model
    from kvscope.sessions import Recorder
    from kvscope.sessions.errors import SessionError
    from kvscope.sessions.lab_input import experiment_prompts

    engine = Engine(load_model("demo"), EngineConfig(num_blocks=32))
    path = tmp_path / "s.kvscope"
    for record_text in (False, True):
        if path.exists():
            path.unlink()
        with Recorder(path, engine, record_text=record_text):
            engine.generate(["The river rose through the night"], SamplingParams(max_tokens=2))
        if not record_text:
            with pytest.raises(SessionError, match="recorded without prompt text .*--record-text"):
                experiment_prompts(path)
    (ids,) = prompt_ids(engine.tokenizer, experiment_prompts(path), 4, 64)
    assert ids == engine.tokenizer.encode("The river rose through the night")
