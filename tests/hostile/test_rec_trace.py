"""The Chrome trace of a recording started on a busy engine: it starts with the recording, what
was running then is drawn running, fork tracks are named for their sample, and cache hits,
copy-on-write and per-request token counts are in it."""

from __future__ import annotations

import json
import re
import time

from rec_util import make_engine, rec_model_dir  # noqa: F401 - a fixture
from session_testutil import prompt

from kvscope.engine import SamplingParams
from kvscope.sessions import Recorder
from kvscope.sessions.export import export_chrome_trace


def test_trace_of_a_recording_started_mid_run(tmp_path, rec_model_dir):  # noqa: F811
    engine = make_engine(rec_model_dir, max_num_seqs=1)  # one runs, the next one waits
    shared = prompt(12, seed=5)
    done = engine.add_request(prompt(6, 1), SamplingParams(max_tokens=2, ignore_eos=True))
    while not engine.requests[done].finished:
        engine.step()
    running = engine.add_request(shared + prompt(5, 2),
                                 SamplingParams(max_tokens=30, ignore_eos=True))
    queued = engine.add_request(prompt(20, 3), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    engine.step()
    time.sleep(1.0)  # the recording starts well after these arrived
    path = tmp_path / "mid.kvscope"
    with Recorder(path, engine):
        sampled = engine.add_request(shared + prompt(3, 4), SamplingParams(
            max_tokens=6, n=3, temperature=1.0, seed=1, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    trace = json.loads(export_chrome_trace(path, tmp_path / "t.json").read_text())["traceEvents"]

    names = {e["tid"]: e["args"]["name"] for e in trace
             if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 2}
    tracks = {int(re.match(r"request (\d+)", n).group(1)): tid for tid, n in names.items()}
    assert done not in tracks  # finished before the recording: not in it
    children = [r for r in engine.requests.values() if r.parent_id == sampled]
    assert len(children) == 2
    for c in children:
        assert names[tracks[c.request_id]] == (f"request {c.request_id} (sample "
                                               f"{c.sample_index + 1} of 3, forked from "
                                               f"request {sampled})")

    timed = [e for e in trace if e["ph"] != "M"]
    assert min(e["ts"] for e in timed) >= 0
    first_step = min(e["ts"] for e in timed if e.get("cat") == "step")
    assert first_step < 200_000  # us: the trace starts with the recording, not at the arrivals

    def spans(rid):
        return sorted((e for e in timed if e["ph"] == "X" and e["pid"] == 2
                       and e["tid"] == tracks[rid]), key=lambda e: e["ts"])

    # running when the recording started: drawn decoding from the start, never "queued"
    assert spans(running)[0]["name"] in ("prefill", "decode")
    assert spans(running)[0]["ts"] == 0
    assert "queued" not in {e["name"] for e in spans(running)}
    assert (spans(queued)[0]["name"], spans(queued)[0]["ts"]) == ("queued", 0)  # waiting then
    for rid in (running, queued, sampled):
        req = engine.requests[rid]
        args = spans(rid)[-1]["args"]
        assert (args["prompt_tokens"], args["cached_tokens"], args["output_tokens"]) == \
            (len(req.prompt_token_ids), req.metrics.cached_tokens, len(req.output_token_ids))
        assert "salt_digest" in args
    instants = {(e["tid"], e["cat"]) for e in timed if e["ph"] == "i" and e["pid"] == 2}
    assert (tracks[sampled], "cache_hit") in instants  # the shared 12-token prefix
    assert any(cat == "cow" for _, cat in instants)
