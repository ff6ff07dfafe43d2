"""The Chrome trace's tracks for a host tier (sessions/export.py), in a session whose engine had
one (engine.host_tier; a session without one gets none of them):

- process "engine", track "host transfers": one span per step that copied blocks between the
  device and the host tier, as long as the copies took (StepRecord.transfer_s), from the step's
  start: they run before the step's forward pass (whose spans on the "steps" track follow
  them). Its args: the blocks offloaded (evicted device blocks copied to the host) and loaded
  (host blocks copied back into device blocks), their bytes where the session knows a block's
  (SessionMeta.block_bytes; not in files from before it was kept), and the step.
- process "engine", counter track "host blocks": the host tier's free, active (held while a
  step loads from them) and cached blocks at the end of each step, from the session's own
  replay (SessionReader.host_blocks), as the "blocks" track has the device's.
"""

from __future__ import annotations

HOST_TRACK = "host transfers"


def transfer_us(step) -> int:
    """A step's host transfers in the trace's microseconds (0 without a copy)."""
    return round(step.transfer_s * 1e6) if step.offloaded_blocks or step.loaded_blocks else 0


def host_tracks(reader, pid: int, tid: int, steps, step_ends: dict[int, int], us) -> list[dict]:
    """The host tier's tracks for `steps` (their records; step_ends: step -> its end in the
    trace's microseconds; us: seconds -> the trace's microseconds), on track `tid` of `pid`."""
    out = [dict(ph="M", pid=pid, tid=tid, name="thread_name", args=dict(name=HOST_TRACK)),
           dict(ph="M", pid=pid, tid=tid, name="thread_sort_index", args=dict(sort_index=tid))]
    block_bytes = reader.meta.block_bytes
    for s in steps:
        if s.offloaded_blocks or s.loaded_blocks:
            a = us(s.start_s)
            args = dict(offloaded_blocks=s.offloaded_blocks, loaded_blocks=s.loaded_blocks)
            if block_bytes:
                args.update(offloaded_bytes=s.offloaded_blocks * block_bytes,
                            loaded_bytes=s.loaded_blocks * block_bytes)
            out.append(dict(ph="X", pid=pid, tid=tid, ts=a,
                            dur=min(transfer_us(s), step_ends[s.step] - a), cat="transfer",
                            name=f"host: {s.offloaded_blocks} out, {s.loaded_blocks} in",
                            args=dict(args, step=s.step)))
    if step_ends:
        for step, counts in reader.host_blocks(min(step_ends), max(step_ends)).items():
            out.append(dict(ph="C", pid=pid, tid=0, name="host blocks", ts=step_ends[step],
                            args=counts._asdict()))
    return out
