"""Frame sources: where the window's frames come from. The window shows one source at a time,
through one path (`open_source`, then `show_frame`); panels never know which source it is.

A source answers four things: the frames that are new (`take_frame`), the frame of any step it
keeps (`frame_at`), why a request missed the cache (`explain`), and its settings; every other
member the window asks of it is declared here with what a source without it answers.
`LiveSource` (live.py) is the engine process (its history is the session the engine always
records); `ReplaySource` (replay.py) a session file; `LabSource` (lab.py) a what-if lab run over
a trace; `AttachSource` (attach.py) a vLLM or SGLang server's KV events."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvscope.app.frames import Frame
from kvscope.engine.explain import MissExplanation
from kvscope.sessions import SessionError

if TYPE_CHECKING:
    from kvscope.sessions import SessionReader

MAX_EVENTS = 20_000  # events kept to show again (the event log keeps as many)


class FrameSource:
    name = ""  # for the status bar: what is shown (a replay's: the file and its model)
    read_only: str | None = None  # why submitting and cancelling are off (None: they are on)
    live = False  # has a newest step that moves on (the window can follow it)
    attached = False  # shows an attached server's cache (hash slots, not physical blocks)
    reader: SessionReader | None = None  # the session file it reads, if it reads one

    def take_frame(self) -> Frame | None:
        """What is new since the last call (None: nothing)."""
        return None

    def step_range(self) -> tuple[int, int] | None:
        """The first and last step `frame_at` can show (None: none yet)."""
        return None

    def frame_at(self, step: int) -> Frame:
        """The state at the end of `step` (raises SessionError if it cannot be shown)."""
        raise SessionError("this source keeps no history")

    def frame_for(self, step: int | None) -> tuple[int | None, Frame | None]:
        """Where the time cursor at `step` (None: the newest step) lands, and the frame to show
        there (None: nothing to show). Looking back at a live source's newest step or past it
        ends the looking back: the cursor follows the newest step again (None) and the newest
        state is shown. Raises SessionError if the step cannot be shown."""
        if self.live:
            steps = self.step_range()
            if step is None or steps is None or step >= steps[1]:
                return None, self.newest()
        return step, None if step is None else self.frame_at(step)

    def newest(self) -> Frame:
        """The newest state, nothing new (to show after looking back)."""
        return Frame()

    def everything(self) -> Frame:
        """The newest state with every record and event kept (to show this source again)."""
        return self.newest()

    def status_text(self, snap) -> str | None:
        """The status bar's line for `snap` (None: the window's own)."""
        return None

    def health(self) -> tuple[str, list[str], bool | None] | None:
        """(one line for the status bar, every line, True when nothing was missed, None while
        nothing has arrived); None for a source that cannot miss anything."""
        return None

    def describe_slot(self, slot: int) -> str | None:
        """What a pool cell holds, when the snapshot cannot say (an attached server's slots)."""
        return None

    def explain(self, request_id: int, step: int | None) -> MissExplanation | None:
        """Why the request missed the prefix cache, as of `step` (None: the newest)."""
        return None

    def settings(self) -> dict:
        """model, num_blocks, block_size, kv_cache_dtype, enable_prefix_caching, policy;
        host_blocks, kv_bytes_per_token, kv_format (the blocks' format, "auto" resolved) and
        kv_parts (its bytes per token and layer by part: format_parts) where known."""
        return {}

    def close(self) -> None:
        pass
