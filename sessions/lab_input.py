"""A recorded session as the cache lab's input: its requests in arrival order (parallel samples
left out: they share their parent's blocks without a lookup), each with the block chain of its
prompt as the recorder stored it, the session's KV-cache groups and its KV bytes per token
(where the file keeps them: the bytes the lab's host tiers move). And a session's prompt texts
for the experiments measured on a prompt set (`experiment_prompts`)."""

from __future__ import annotations

from pathlib import Path

from kvscope.lab.traces import LabRequest, Trace, TraceError, detect_format, load_trace
from kvscope.sessions.errors import SessionError
from kvscope.sessions.reader import SessionReader


def load_lab_input(path: str | Path, fmt: str | None = None, limit: int | None = None) -> Trace:
    """A Mooncake or Bailian trace, or a `.kvscope` session (format detected when fmt is None)."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    if (fmt or detect_format(path)) != "session":
        return load_trace(path, fmt, limit)
    try:
        with SessionReader(path) as reader:
            block_size = reader.meta.block_size
            chains = reader.request_chains()
            requests = [r for r in reader.requests() if r.parent_id is None]
            groups = reader.groups
            per_token = reader.meta.kv_bytes_per_token
    except SessionError as e:
        raise TraceError(str(e)) from None
    node_of: dict[tuple, int] = {}
    lab = []
    for r in requests[:limit]:
        nodes, node = [], -1
        chain = chains.get(r.request_id)
        for h in chain.tolist() if chain is not None else []:
            node = node_of.setdefault((node, h), len(node_of))
            nodes.append(node)
        if r.prompt_tokens % block_size:  # the partial last block is this request's own
            nodes.append(node_of.setdefault((node, ("own", r.request_id)), len(node_of)))
        lab.append(LabRequest(r.arrival_s, r.prompt_tokens, r.output_tokens or 0, tuple(nodes),
                              r.cache_breakpoint))
    if not lab:
        raise TraceError(f"{path}: the session has no requests")
    t0 = lab[0].arrival_s
    lab = [LabRequest(r.arrival_s - t0, r.input_length, r.output_length, r.nodes, r.breakpoint)
           for r in lab]
    return Trace(path.name, "session", block_size, lab, 0, groups, per_token)


def experiment_prompts(path: str | Path) -> str | list[str]:
    """What `lab.experiments.run(prompts=...)` takes for a file: a workload's path as it is, a
    session's recorded prompt texts (refused, naming the way to record them, without)."""
    path = Path(path)
    if path.suffix == ".jsonl":
        return str(path)
    with SessionReader(path) as reader:
        if not reader.meta.record_text:
            raise SessionError(f"{path}: the session was recorded without prompt text (record "
                               "with --record-text to measure on its prompts)")
        return [r.prompt_text for r in reader.requests() if r.prompt_text]
