"""The Chrome trace's tracks for KV-cache groups (sessions/export.py), in a session with more
than one group (a one-group session gets none of them):

- process "engine", a counter track per group, "blocks: <group>" (e.g. "blocks: sliding window
  4096"), with the blocks the group holds (ref count >= 1) and keeps cached (ref count 0, hash
  kept) at the end of each step; a block counts in the group that last allocated it. They come
  from the session's own replay (SessionReader.group_blocks), not from the step records, which
  count the pool as a whole.
- process "engine", an instant track per group, "cache: <group>", with that group's block
  events: allocated, cached, evicted (blocks evicted to allocate for this group),
  out_of_window (released by a sliding window while the request runs) and freed.
"""

from __future__ import annotations

from kvscope.engine import events as ev
from kvscope.engine.kv_groups import NULL

GROUP_EVENTS = (ev.ALLOCATED, ev.CACHED, ev.EVICTED, ev.OUT_OF_WINDOW, ev.FREED)
FIRST_GROUP_TID = 3  # after the engine's "steps" and "cache" tracks


def group_tracks(reader, pid: int, step_ends: dict[int, int], events, us_ns) -> list[dict]:
    """The group tracks for the steps in `step_ends` (step -> its end in the trace's
    microseconds) and their `events`; us_ns: an event's time in the trace's microseconds."""
    groups = reader.groups
    out: list[dict] = []
    for g, group in enumerate(groups):
        tid = FIRST_GROUP_TID + g
        out.append(dict(ph="M", pid=pid, tid=tid, name="thread_name",
                        args=dict(name=f"cache: {group.name}")))
        out.append(dict(ph="M", pid=pid, tid=tid, name="thread_sort_index",
                        args=dict(sort_index=tid)))
    if step_ends:
        counts = reader.group_blocks(min(step_ends), max(step_ends))
        for step, (held, cached) in counts.items():
            for g, group in enumerate(groups):
                out.append(dict(ph="C", pid=pid, tid=0, name=f"blocks: {group.name}",
                                ts=step_ends[step],
                                args=dict(held=int(held[g]), cached=int(cached[g]))))
    for e in events:
        if e.kind in GROUP_EVENTS:
            blocks = [b for b in e.blocks if b != NULL]
            name = f"{e.kind.replace('_', ' ')} {len(blocks)} block(s)"
            out.append(dict(ph="i", s="t", pid=pid, tid=FIRST_GROUP_TID + e.group, name=name,
                            ts=us_ns(e.time_ns), cat=e.kind,
                            args=dict(step=e.step, request=e.request_id, blocks=blocks,
                                      group=groups[e.group].name)))
    return out
