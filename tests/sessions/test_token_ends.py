"""A session recorded with text keeps where each token's text ends, so a replay can cut the
prompt and the output at token boundaries; without text, and in files from before, there are
none."""

from __future__ import annotations

from pathlib import Path

from kvscope.engine.token_text import split_at
from kvscope.sessions import Recorder, SessionReader

OLD = Path(__file__).parents[1] / "data" / "session_before_step_stream.kvscope"


def test_token_ends_cut_the_recorded_text_one_piece_per_token(tmp_path):
    from kvscope.engine import Engine, EngineConfig, SamplingParams

    for record_text in (True, False):
        engine = Engine.from_pretrained("demo", EngineConfig(num_blocks=64))
        path = tmp_path / f"ends-{record_text}.kvscope"
        with Recorder(path, engine, record_text=record_text):
            engine.generate(["naïve café — 日本語 and a list", "another prompt"],
                            SamplingParams(max_tokens=6, ignore_eos=True))
        with SessionReader(path) as reader:
            for r in reader.requests():
                prompt_ends, output_ends = reader.token_ends(r.request_id)
                if not record_text:
                    assert (prompt_ends, output_ends) == (None, None)
                    continue
                assert len(prompt_ends) == r.prompt_tokens and len(output_ends) == 6
                assert "".join(split_at(r.prompt_text, prompt_ends)) == r.prompt_text
                assert prompt_ends[-1] == len(r.prompt_text)
                assert output_ends[-1] == len(r.output_text)
                assert reader.request(r.request_id) == r
            assert reader.request(99) is None


def test_a_file_from_before_has_no_token_ends():
    with SessionReader(OLD) as reader:
        rid = reader.requests()[0].request_id
        assert reader.token_ends(rid) == (None, None)
