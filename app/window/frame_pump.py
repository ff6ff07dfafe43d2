"""From the source shown to the panels: the frames pulled up to ~30 times a second, the time
cursor (the step shown: Home, End, ← →, every panel's step clicks), and the pace of the
prefix tree's rebuild (the slowest panel)."""

from __future__ import annotations

import time

from PySide6.QtCore import QTimer

from kvscope.app.frames import Frame
from kvscope.sessions import SessionError

FRAME_MS = 33  # the GUI pulls at most ~30 frames a second
TREE_HZ = 4  # the prefix tree is rebuilt at most this often
TREE_MAX_SKIPS = 8  # frames in a row the tree yields to the timeline before it runs anyway


class FramePump:
    """Shows the window's source (`window.source`) in its panels (`window.panels`), then the
    status bar and the attach overlay; keeps `window.snapshot`, the snapshot shown."""

    def __init__(self, window):
        self.w = window
        self.tree_due = 0.0  # when the tree may start its next rebuild (time.monotonic())
        self.tree_skips = 0  # frames the tree gave to the timeline since it last caught up
        self.paint_s = 0.0  # seconds spent painting the window right after the last frame
        self.frame_end = 0.0
        self.timer = QTimer(window)
        self.timer.timeout.connect(self.pull)
        window.selection.step_changed.connect(self.on_cursor)

    def pull(self) -> None:
        """A timer tick: show what is new in the source."""
        w = self.w
        frame = w.source.take_frame()
        if frame is None:
            self.update_tree()  # the source is quiet: the tree catches up with the last frame
            return
        if w.selection.step is not None:  # the user looks at a past step: keep it
            frame = Frame(records=frame.records, events=frame.events, text=frame.text)
        t0 = time.monotonic()
        self.show(frame)
        # However costly a frame is to draw, painting included (the paint that followed the
        # previous frame: this one's is done by the event loop, just after), the window leaves
        # two thirds of its time to input, and as much CPU and memory bandwidth to the engine
        # process (on a small machine they share more than the cores).
        self.frame_end = time.monotonic()
        cost = self.frame_end - t0 + self.paint_s
        self.paint_s = 0.0
        self.timer.setInterval(max(FRAME_MS, int(3000 * cost)))

    def timed_paint(self, event, handle) -> bool:
        """The window's paint (`handle(event)`, an UpdateRequest): timed when it is a frame's."""
        t0 = time.monotonic()  # the window paints every widget that changed, views included
        handled = handle(event)
        if t0 - self.frame_end < self.paint_s + FRAME_MS / 1000:  # a frame's, not a hover's
            self.paint_s += time.monotonic() - t0
        return handled

    def show(self, frame: Frame) -> None:
        """The one path from a source to the panels."""
        w = self.w
        w.selection.freed.follow(frame.events)  # before the panels: they outline from it
        if frame.snapshot is not None:
            w.snapshot = frame.snapshot
        for panel in w.panels.values():
            panel.show_frame(frame)
        # The two costly panels take turns; the tree waits TREE_MAX_SKIPS frames at most (a run
        # whose every frame redraws the timeline would draw the tree only at its end).
        if not w.timeline.redrew or self.tree_skips >= TREE_MAX_SKIPS:
            self.update_tree()
        else:
            self.tree_skips += 1
        self.show_status(frame.records)
        w.attach_view.after_frame(frame)
        w.fleet_view.after_frame(frame)

    def show_status(self, records=()) -> None:
        w = self.w
        w.status.show_frame(w.snapshot, records, w.source, w.selection.step, w.model_name,
                            w.engine, w.engine_controls.run_state())

    def update_tree(self) -> None:
        """The slowest panel: rebuilt at most TREE_HZ times a second, one slice of the rebuild
        per frame (none pays for all of it), and once more after the last frame."""
        tree, now = self.w.tree, time.monotonic()
        if tree.pending:
            tree.advance()
        elif (now >= self.tree_due and not self.w.docks["tree"].visibleRegion().isEmpty()
                and tree.start_rebuild()):
            self.tree_due = now + 1 / TREE_HZ
        if not tree.pending:
            self.tree_skips = 0  # drawn, or nothing to draw: the tree waits for nothing

    # ---------------------------------------------------------- time cursor
    def move_cursor(self, delta: int) -> None:
        steps = self.w.source.step_range()
        if steps is None:
            return
        sel = self.w.selection
        now = sel.step if sel.step is not None else steps[1]
        sel.select_step(max(steps[0], min(steps[1], now + delta)))

    def first_step(self) -> None:
        steps = self.w.source.step_range()
        if steps is not None:
            self.w.selection.select_step(steps[0])

    def follow(self) -> None:
        """End: back to the newest step (live), or the last step (replay)."""
        source = self.w.source
        steps = source.step_range()
        self.w.selection.select_step(None if source.live or steps is None else steps[1])

    def on_cursor(self, step: int | None) -> None:
        """The time cursor moved: every panel shows that step."""
        w = self.w
        w.act_follow.setEnabled(w.source.live and step is not None)  # the replay bar's own
        try:
            landed, frame = w.source.frame_for(step)
        except SessionError as e:
            w.banner.show_error(f"Cannot show step {step}: {e}")
            return
        if landed != step:
            w.selection.select_step(landed)  # the newest step: follow it again
            return
        if frame is not None:
            self.show(frame)
            if step is not None:
                w.tree.flush()
