from hypothesis import given
from hypothesis import strategies as st

from kvscope.engine.config import SamplingParams
from kvscope.engine.metrics import RequestMetrics
from kvscope.engine.request import Request


@given(st.lists(st.integers(), min_size=1, max_size=12), st.lists(st.integers(), max_size=12),
       st.data())
def test_token_ids_between_is_a_slice_of_all_tokens(prompt, output, data):
    req = Request(0, prompt, SamplingParams(), RequestMetrics(0.0), output_token_ids=output)
    n = req.num_tokens
    start = data.draw(st.integers(0, n))
    end = data.draw(st.integers(start, n))
    assert req.token_ids_between(start, end) == req.all_token_ids[start:end]
