"""Request sequences for the differential tests, and one loop that plays a sequence on a side.

The loop is a small deterministic scheduler (admit in arrival order while the pool has room,
one decode token per running request per step, preempt the newest running request when a
decode finds no block, as vLLM's scheduler does), so both sides see exactly the same calls as
long as they agree; the first disagreement fails at the call where it happens.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field


@dataclass
class Req:
    rid: int
    prompt: list[int]
    output: list[int]  # the tokens it will decode, in order
    salt: str | None = None
    arrival_step: int = 0


@dataclass
class Trace:
    """What one side did, in the loop's order; two sides must produce equal traces."""

    hits: dict = field(default_factory=dict)  # rid -> hit tokens at each admission
    removed: list = field(default_factory=list)  # (step, rid or None, content names) per op
    resident: list = field(default_factory=list)  # after each step: sorted (name, copies)
    preempted: list = field(default_factory=list)  # (step, rid)


def multi_turn(seed: int, users: int = 6, turns: int = 4, system_len: int = 40,
               salted: bool = True, vocab: int = 5000) -> list[Req]:
    """Chat traffic: a shared system prompt, each user's turns resending the conversation so
    far with its previous answers (as a chat client does), some users under a cache salt,
    prompt lengths both block-aligned and not, arrivals spread over steps."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(system_len)]
    reqs: list[Req] = []
    for u in range(users):
        salt = f"tenant-{u % 2}" if salted and u % 3 == 0 else None
        history = list(system)
        step = rng.randrange(4)
        for _ in range(turns):
            n = rng.choice([16, 32, rng.randrange(1, 40)])  # aligned resends make copies
            history += [rng.randrange(vocab) for _ in range(n)]
            out = [rng.randrange(vocab) for _ in range(rng.choice([3, 16, rng.randrange(1, 30)]))]
            reqs.append(Req(len(reqs), list(history), out, salt, step))
            history += out
            step += rng.randrange(2, 12)
    reqs.sort(key=lambda r: (r.arrival_step, r.rid))
    return reqs


def mooncake(path, limit: int, block_size: int = 16) -> list[Req]:
    """A Mooncake trace's requests as tokens: each 512-token trace block id stands for its own
    run of token ids (equal ids give equal tokens, so equal prefixes hash equal on any side);
    the tail after the last full trace block is unique to the request. No outputs (the lab's
    sequential mode: one request at a time)."""
    reqs = []
    with open(path) as f:
        for i, line in zip(range(limit), f, strict=False):
            r = json.loads(line)
            n, ids = r["input_length"], r["hash_ids"]
            tokens = [h * 512 + j for h in ids for j in range(512)][:n]
            tokens += [-(i * 1_000_000 + j) - 1 for j in range(n - len(tokens))]
            reqs.append(Req(i, tokens, [], None, i))
    return reqs


def play(side, reqs: list[Req], max_steps: int = 100_000, sequential: bool = False,
         on_step=None) -> Trace:
    """Run the requests to completion on `side` (VllmSide or OurSide). `sequential`: one
    request at a time, freed right after its prefill and decodes (the lab's mode). on_step(step):
    called after each step (a server publishes the step's events there)."""
    t = Trace()
    waiting = list(reqs)
    running: list[Req] = []
    decoded: dict[int, int] = {}
    tokens: dict[int, list[int]] = {}
    for step in range(max_steps):
        if not waiting and not running:
            return t
        while waiting and waiting[0].arrival_step <= step and not (sequential and running):
            r = waiting[0]
            prompt = tokens.get(r.rid, r.prompt)  # after a preemption: everything known
            hit = side.admit(r.rid, prompt, r.salt)
            t.removed.append((step, r.rid, side.take_removed()))
            if hit is None:
                if running:
                    break  # waits for room
                t.hits.setdefault(r.rid, []).append(None)  # larger than the whole pool
                waiting.pop(0)
                continue
            t.hits.setdefault(r.rid, []).append(hit)
            waiting.pop(0)
            running.append(r)
            decoded.setdefault(r.rid, 0)
        for r in list(running):
            if r not in running:
                continue  # preempted below in this step
            if decoded[r.rid] == len(r.output):
                side.free(r.rid)
                running.remove(r)
                t.removed.append((step, r.rid, side.take_removed()))
                continue
            ok = side.decode(r.rid, r.output[decoded[r.rid]])
            t.removed.append((step, r.rid, side.take_removed()))
            decoded[r.rid] += 1
            while not ok:
                victim = running.pop()  # the newest running request gives its blocks back
                tokens[victim.rid] = side.tokens(victim.rid)
                side.free(victim.rid)
                t.removed.append((step, victim.rid, side.take_removed()))
                t.preempted.append((step, victim.rid))
                waiting.insert(0, victim)
                if victim is r:
                    break
                ok = side.retry(r.rid)
                t.removed.append((step, r.rid, side.take_removed()))
        t.resident.append(sorted(side.resident.items(), key=repr))
        if on_step is not None:
            on_step(step)
    raise AssertionError(f"not finished after {max_steps} steps")
