"""Workload files, and a runner that feeds one to an engine. Torch-free: the runner only talks to
the engine object it is given.

A workload is a JSON Lines file: one JSON object per line. Blank lines and lines whose first
non-blank character is ``#`` are skipped. A line is either a shared-prefix definition::

    {"define_prefix": "system", "text": "You are a careful assistant. ..."}

or a request::

    {"arrival_s": 0.5, "prefix": "system", "prompt": "User: what is a list?\\nAssistant:",
     "max_tokens": 32, "temperature": 0.0, "cache_salt": "tenant-a", "id": "q1"}

Request keys (only ``prompt`` or ``prompt_ids`` is required):

- ``arrival_s`` (number in [0, 604800], a week; default 0): when to submit, in seconds from
  the start of the run. Lines need not be sorted; ties keep file order.
- ``prompt`` (text) or ``prompt_ids`` (a list of token ids), exactly one of them. Text is encoded
  with the model's tokenizer (which adds its BOS token, if any).
- ``prefix``: the name of a prefix defined on an earlier line. The prompt becomes the prefix's
  text followed by the prompt (text + text is joined before encoding; with ``prompt_ids`` the
  encoded prefix is followed by the ids).
- sampling: ``max_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``n``, ``stop`` (a
  string or a list of non-empty strings), ``ignore_eos``; defaults and ranges are
  ``SamplingParams``'s.
- ``cache_salt`` (string): the tenant / trust domain; prefixes are never shared across salts.
- ``cache_breakpoint``: where an API's prompt cache would stop (a ``cache_control`` mark): a
  number of prompt tokens, or ``"prefix"``: the end of the line's ``prefix`` (the system
  prompt; not on chat lines). The engine caches every full block regardless; the breakpoint is
  recorded with the request, and the lab bills a recorded session with it
  (``kvscope lab SESSION --ttl S``; kvscope.lab.billing). Without it every full block counts.
- ``id`` (string or integer): a name other lines can refer to; unique in the file.
- ``follows``: the ``id`` of an earlier line. This request is submitted only once that one has
  finished (and its own ``arrival_s`` has passed), and its prompt is that request's prompt token
  ids + its generated token ids + this line's prompt (encoded without a BOS token): a chat turn
  that resends its history, so the full blocks of the previous prompt and answer are reused. With
  ``n`` > 1 on the earlier line, the first sample is the history. It cannot be combined with
  ``prefix`` (the history already starts with it), and if the earlier request was rejected or
  cancelled this one is skipped.
- ``chat`` (true/false, default false): ``prompt`` is a user message of a conversation formatted
  with the model's chat template (the prefix, if any, is the system message). With ``follows``
  (of another chat line) the conversation resent is the earlier one, its answer as text, and this
  message, re-templated and re-encoded as a chat client does; the cache reuses every block whose
  tokens come out the same. Needs a model with a chat template (``--model smollm2``).

Errors name the file and line: ``WorkloadError("chat.jsonl:7: unknown key 'promt'")``.

Running one: `kvscope.lab.workload_run`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

from kvscope.engine.config import SamplingParams, check_text, is_int, is_number, shown

SAMPLING_KEYS = tuple(f.name for f in fields(SamplingParams))
REQUEST_KEYS = ("arrival_s", "prompt", "prompt_ids", "prefix", "cache_salt", "id", "follows",
                "chat", "cache_breakpoint", *SAMPLING_KEYS)
PREFIX_KEYS = ("define_prefix", "text")


class WorkloadError(ValueError):
    """A workload file or line is invalid; the message names the file and line."""


@dataclass
class WorkloadRequest:
    line: int  # 1-based line number in the file
    params: SamplingParams
    arrival_s: float = 0.0
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    prefix: str | None = None  # the prefix's name
    prefix_text: str = ""  # the prefix's text ("" without a prefix)
    cache_salt: str | None = None
    id: str | None = None
    follows: str | None = None
    chat: bool = False
    cache_breakpoint: int | str | None = None  # tokens, or "prefix" (its end)

    @property
    def needs_tokenizer(self) -> bool:
        return self.prompt is not None or bool(self.prefix_text)


@dataclass
class Workload:
    requests: list[WorkloadRequest]
    prefixes: dict[str, str] = field(default_factory=dict)
    source: str = "<workload>"

    def __len__(self) -> int:
        return len(self.requests)


# ------------------------------------------------------------------------------------ parsing
def load_workload(path: str | os.PathLike) -> Workload:
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"cannot read workload {name}: {e}") from None
    return parse_workload(text.splitlines(), source=os.path.basename(name))


def parse_workload(lines: str | Iterable[str], source: str = "<workload>") -> Workload:
    if isinstance(lines, str):
        lines = lines.splitlines()
    prefixes: dict[str, str] = {}
    requests: list[WorkloadRequest] = []
    ids: dict[str, bool] = {}  # id -> is a chat line
    for lineno, raw in enumerate(lines, 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue

        def fail(msg: str, lineno=lineno) -> WorkloadError:
            return WorkloadError(f"{source}:{lineno}: {msg}")

        try:
            obj = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise fail(f"bad JSON: {e.msg} (column {e.colno})") from None
        except RecursionError:
            raise fail("bad JSON: nested too deeply") from None
        except ValueError as e:  # e.g. an integer literal of more than 4300 digits
            raise fail(f"bad JSON: {str(e).splitlines()[0]}") from None
        if not isinstance(obj, dict):
            raise fail(f"expected a JSON object, got {type(obj).__name__}")
        if "define_prefix" in obj:
            name, text = _parse_prefix(obj, prefixes, fail)
            prefixes[name] = text
            continue
        req = _parse_request(obj, lineno, prefixes, ids, fail)
        if req.id is not None:
            ids[req.id] = req.chat
        requests.append(req)
    if not requests:
        raise WorkloadError(f"{source}: no requests in the workload")
    return Workload(requests, prefixes, source)


def _parse_prefix(obj: dict, prefixes: dict[str, str], fail) -> tuple[str, str]:
    unknown = [k for k in obj if k not in PREFIX_KEYS]
    if unknown:
        raise fail(f"unknown key {unknown[0]!r} in a prefix definition "
                   f"(allowed: {', '.join(PREFIX_KEYS)})")
    name, text = obj["define_prefix"], obj.get("text")
    if not isinstance(name, str) or not name:
        raise fail("define_prefix must be a non-empty string")
    if name in prefixes:
        raise fail(f"prefix {name!r} is defined twice")
    if not isinstance(text, str) or not text:
        raise fail(f"prefix {name!r} needs a non-empty string 'text'")
    try:
        check_text(text, f"prefix {name!r}")
    except ValueError as e:
        raise fail(str(e)) from None
    return name, text


MAX_ARRIVAL_S = 7 * 24 * 3600.0  # a week: later arrivals are typos (or 1e300)
TOKEN_ID_LIMIT = 2**63  # token ids are int64 in the engine


def _is_token_ids(v) -> bool:
    return isinstance(v, list) and all(is_int(t) and 0 <= t < TOKEN_ID_LIMIT for t in v)


_CHECKS = {  # request key -> (test, what it must be); sampling keys: SamplingParams checks
    "arrival_s": (lambda v: is_number(v) and 0 <= v <= MAX_ARRIVAL_S,
                  f"a number of seconds in [0, {MAX_ARRIVAL_S:.0f}]"),
    "prompt": (lambda v: isinstance(v, str), "a string"),
    "prompt_ids": (_is_token_ids, "a list of integer token ids in [0, 2**63)"),
    "prefix": (lambda v: isinstance(v, str), "a string"),
    "cache_salt": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "id": (lambda v: isinstance(v, str) or is_int(v), "a string or an integer"),
    "follows": (lambda v: isinstance(v, str) or is_int(v), "a string or an integer"),
    "chat": (lambda v: isinstance(v, bool), "true or false"),
    "cache_breakpoint": (lambda v: v == "prefix" or (is_int(v) and 0 <= v < TOKEN_ID_LIMIT),
                         '"prefix" or a whole number of tokens >= 0'),
}


def _check_texts(obj: dict) -> None:
    for key, value in obj.items():
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str):
                check_text(text, key)


def _parse_request(obj: dict, lineno: int, prefixes: dict[str, str], ids: dict[str, bool],
                   fail) -> WorkloadRequest:
    unknown = [k for k in obj if k not in REQUEST_KEYS]
    if unknown:
        raise fail(f"unknown key {unknown[0]!r} (allowed: {', '.join(REQUEST_KEYS)})")
    for key, value in obj.items():
        test, what = _CHECKS.get(key, (None, ""))
        if test is not None and not test(value):
            raise fail(f"{key} must be {what}, got {shown(value)}")
    if ("prompt" in obj) == ("prompt_ids" in obj):
        raise fail("a request needs exactly one of 'prompt' (text) or 'prompt_ids'"
                   if "prompt" in obj else "missing 'prompt' (or 'prompt_ids')")
    try:
        _check_texts(obj)
        params = SamplingParams(**{k: obj[k] for k in SAMPLING_KEYS if k in obj})
    except ValueError as e:
        raise fail(str(e).removeprefix("SamplingParams.")) from None
    req = WorkloadRequest(lineno, params, float(obj.get("arrival_s", 0.0)), obj.get("prompt"),
                          obj.get("prompt_ids"), obj.get("prefix"),
                          cache_salt=obj.get("cache_salt"))
    if "id" in obj:
        req.id = str(obj["id"])
        if req.id in ids:
            raise fail(f"id {req.id!r} is used by an earlier line")
    if req.prefix is not None:
        if req.prefix not in prefixes:
            known = ", ".join(map(repr, prefixes)) or "none defined"
            raise fail(f"unknown prefix {req.prefix!r} (define it on an earlier line with "
                       f'{{"define_prefix": ..., "text": ...}}; known: {known})')
        req.prefix_text = prefixes[req.prefix]
    if "follows" in obj:
        req.follows = str(obj["follows"])
        if req.follows not in ids:
            raise fail(f"follows unknown id {req.follows!r} (it must be the id of an earlier "
                       "line)")
        if req.prefix is not None:
            raise fail("'follows' and 'prefix' cannot be combined: the history already "
                       "starts with the prefix")
    elif not req.prefix_text and not (req.prompt or req.prompt_ids):
        raise fail("empty prompt")
    req.chat = obj.get("chat", False)
    req.cache_breakpoint = obj.get("cache_breakpoint")
    if req.cache_breakpoint == "prefix" and (req.prefix is None or req.chat):
        raise fail('cache_breakpoint "prefix" needs a plain line with a \'prefix\' (a chat '
                   "line's system prompt is templated: give a number of tokens)")
    if req.chat and req.prompt is None:
        raise fail("a chat line's prompt is a message: use 'prompt', not 'prompt_ids'")
    if req.follows is not None and req.chat != ids[req.follows]:
        raise fail(f"a {'chat' if req.chat else 'plain'} line cannot follow "
                   f"{'a plain' if req.chat else 'a chat'} line ({req.follows!r})")
    return req
