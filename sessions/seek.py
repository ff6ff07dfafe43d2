"""Seeking in a session: the block state at any step, from the nearest keyframe and the
recorded events replayed through the engine's own pool (PoolReplay, replay.py). Torch-free.

`Seeking` is SessionReader's half that replays: `snapshot_at`, `playback`, `verify`, and
`group_blocks` (the blocks of each KV-cache group, step by step). It keeps replays at keyframes
(and halfway to the next) so that a seek copies one rather than decoding a keyframe and
rebuilding its pool, and a cursor that moves forward from where the last seek left it."""

from __future__ import annotations

import functools
import sqlite3
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kvscope.engine.block_pool import BlockCounts
from kvscope.engine.events import Event
from kvscope.engine.kv_groups import ONE_GROUP, KVGroup
from kvscope.engine.metrics import StepRecord
from kvscope.engine.snapshot import Snapshot
from kvscope.sessions import schema
from kvscope.sessions.errors import CorruptSessionError, SessionError, db_error
from kvscope.sessions.replay import PoolReplay
from kvscope.sessions.schema import TOTALS

# Replays kept for seeking, at keyframes and halfway between them: at most KEPT_REPLAYS, and
# KEPT_BLOCKS blocks in all (one replay at least; about 180 bytes a block, so about 47 MB at
# most). Intervals shorter than twice MIN_HALF_INTERVAL steps are not split.
KEPT_REPLAYS, KEPT_BLOCKS, MIN_HALF_INTERVAL = 16, 1 << 18, 16


@dataclass
class Frame:
    """One step of playback."""

    record: StepRecord
    events: list[Event]
    snapshot: Snapshot


class Seeking:
    """SessionReader's replaying half (it reads through the reader's `_query`, `_steps`,
    `_captured`, `keyframe_steps`, `meta`, `_policy`, `_host_policy` and `_conn`)."""

    def snapshot_at(self, step: int) -> Snapshot:
        """The block state at the end of `step`, equal to the live engine's snapshot then."""
        self._check_step(step)
        k = bisect_right(self.keyframe_steps, step) - 1
        if k < 0:
            raise CorruptSessionError(f"{self.path}: damaged session: no keyframe at or before "
                                      f"step {step}")
        base = self.keyframe_steps[k]
        cur = self._cursor
        # the nearest replay kept between the keyframe and the step (see _midpoint)
        kept = max((s for s in self._at_keyframe if base < s <= step), default=None)
        if cur is not None and base <= cur.step <= step and (kept is None or cur.step >= kept):
            if cur.step == step:
                return cur.snapshot()
        elif kept is not None:
            cur = self._cursor = self._replay_at(kept)
        else:
            if base == step:
                kf = self._keyframe(base)
                self._cursor = self._replay_at(base, kf)
                return kf
            cur = self._cursor = self._replay_at(base)
        mid = self._midpoint(k)
        try:
            if mid is not None and cur.step < mid < step and mid not in self._at_keyframe:
                self._advance(cur, mid)  # kept on the way: later seeks past it start there
                self._keep(mid, cur.copy())
            self._advance(cur, step)
        except BaseException:
            self._cursor = None  # half-replayed: start from a keyframe next time
            raise
        return cur.snapshot()

    def _check_step(self, step: int) -> None:
        if not self._steps or not self.first_step <= step <= self.last_step:
            rng = f"{self.first_step}..{self.last_step}" if self._steps else "none"
            raise IndexError(f"step {step} is not in this session (steps {rng})")
        if step not in self._captured:
            raise SessionError(f"step {step} was published without its block state (the "
                               "recorder missed it); its neighbours replay normally")

    def _replay_at(self, base: int, kf: Snapshot | None = None) -> PoolReplay:
        """A fresh replay from step `base`: a copy of the one kept there, or of a new one from
        the keyframe at `base`."""
        kept = self._at_keyframe
        if base in kept:
            kept.move_to_end(base)
        else:
            self._keep(base, PoolReplay(self._keyframe(base) if kf is None else kf,
                                        self._policy, self._host_policy))
        return kept[base].copy()

    def _keep(self, step: int, replay: PoolReplay) -> None:
        kept = self._at_keyframe
        kept[step] = replay
        keep = max(1, min(KEPT_REPLAYS, KEPT_BLOCKS // max(1, self.meta.num_blocks)))
        while len(kept) > keep:
            kept.popitem(last=False)

    def _midpoint(self, k: int) -> int | None:
        """The step halfway through keyframe k's interval, where a seek keeps a replay (half the
        events to replay from there on); None in a short interval."""
        base = self.keyframe_steps[k]
        end = (self.keyframe_steps[k + 1] if k + 1 < len(self.keyframe_steps)
               else self.last_step)
        return base + (end - base) // 2 if end - base >= MIN_HALF_INTERVAL * 2 else None

    def _keyframe(self, step: int) -> Snapshot:
        conn = self._conn
        conn.row_factory = sqlite3.Row
        try:
            row = conn.execute("SELECT * FROM keyframes WHERE step = ?", (step,)).fetchone()
        except sqlite3.DatabaseError as e:
            raise db_error(self.path, e) from e
        finally:
            conn.row_factory = None
        if row is None:
            raise CorruptSessionError(f"{self.path}: damaged session: keyframe {step} missing")
        try:
            return schema.decode_keyframe(dict(row))
        except Exception as e:  # noqa: BLE001 - zlib / numpy / json errors of a damaged row
            raise CorruptSessionError(f"{self.path}: damaged keyframe at step {step}: {e}") \
                from e

    @functools.cached_property
    def groups(self) -> tuple[KVGroup, ...]:
        """The session's KV-cache groups, as its first keyframe has them (one full-attention
        group in a file from before groups)."""
        return self._keyframe(self.keyframe_steps[0]).groups if self.keyframe_steps else \
            ONE_GROUP

    @functools.cached_property
    def has_host_tier(self) -> bool:
        """The session's engine had a host tier (engine.host_tier), as its first keyframe has
        it (none in a file from before host tiers)."""
        return bool(self.keyframe_steps) and \
            self._keyframe(self.keyframe_steps[0]).host is not None

    def group_blocks(self, first: int, last: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """For each step first..last with its block state: the blocks held and cached in each
        KV-cache group at its end (BlockPool.group_counts), by one replay forward."""
        n = len(self.groups)
        return self._each_step(first, last, lambda cur: cur.pool.group_counts(n))

    def host_blocks(self, first: int, last: int) -> dict[int, BlockCounts]:
        """For each step first..last with its block state: the host tier's blocks (free, active:
        held while loaded from, cached) at its end, by one replay forward; empty in a session
        without a host tier."""
        if not self.has_host_tier:
            return {}
        return self._each_step(first, last, lambda cur: cur.host.counts())

    def _each_step(self, first: int, last: int, of) -> dict:
        """{step: of(replay at its end)} for each step first..last with its block state."""
        captured = [s for s in range(max(first, self.first_step or 0),
                                     min(last, self.last_step or -1) + 1) if s in self._captured]
        if not captured:
            return {}
        self.snapshot_at(captured[0])  # the cursor, there
        cur = self._cursor
        out = {captured[0]: of(cur)}
        try:
            self._advance(cur, captured[-1], on_step=lambda s: out.__setitem__(s, of(cur)))
        except BaseException:
            self._cursor = None
            raise
        return out

    def _advance(self, cur: PoolReplay, step: int, on_step=None) -> None:
        """Replay steps cur.step+1 .. step on the cursor; on_step(s) after each step s with its
        block state."""
        first = cur.step + 1
        have = set(self._step_columns)  # (totals added since a file was written: 0 there)
        totals_cols = [c if c in have else "0" for c in TOTALS.values()]
        rows = self._query(f"SELECT step, nct, captured, {', '.join(totals_cols)} FROM steps "
                           "WHERE step BETWEEN ? AND ? ORDER BY step", (first, step))
        events = self._query(f"SELECT {', '.join(schema.EVENT_COLUMNS)} FROM events "
                             "WHERE step BETWEEN ? AND ? ORDER BY step", (first, step))
        i, n = 0, len(events)
        try:
            for s, blob, captured, *totals in rows:
                while i < n and events[i][0] == s:
                    cur.apply_packed(events[i])
                    i += 1
                if not captured:
                    continue  # only the block events are known; the next keyframe resyncs
                cur.end_step(s, schema.decode_nct(blob), dict(zip(TOTALS, totals, strict=True)))
                if on_step is not None:
                    on_step(s)
        except (ValueError, IndexError, TypeError, KeyError) as e:
            raise CorruptSessionError(f"{self.path}: damaged steps {first}..{step}: {e}") from e
        cur.step = step

    def playback(self, first: int | None = None, last: int | None = None) -> Iterator[Frame]:
        """Frames for steps first..last, each built incrementally from the previous one."""
        first = self.first_step if first is None else first
        last = self.last_step if last is None else last
        if not self._steps:
            return
        for rec in self.steps(first, last):
            if rec.step in self._captured:
                yield Frame(rec, self.events_at(rec.step), self.snapshot_at(rec.step))

    __iter__ = playback

    def verify(self) -> list[str]:
        """Replay each keyframe's interval and compare with the next keyframe. Returns the
        problems found (empty: the events reproduce every keyframe exactly)."""
        problems = []
        for a, b in zip(self.keyframe_steps, self.keyframe_steps[1:], strict=False):
            cur = PoolReplay(self._keyframe(a), self._policy, self._host_policy)
            try:
                self._advance(cur, b)
                if not cur.snapshot().equals(self._keyframe(b)):
                    problems.append(f"steps {a}..{b}: replay differs from the keyframe at {b}")
            except SessionError as e:
                problems.append(f"steps {a}..{b}: {e}")
        return problems
