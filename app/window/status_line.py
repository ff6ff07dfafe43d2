"""The status bar's line for a frame: live, looking back in the history, or replaying; the
blocks of the step shown; tokens per second over the last two seconds of steps."""

from __future__ import annotations

from PySide6.QtWidgets import QLabel

HINT = "Press Run demo (F5) or type a prompt"


class StatusLine(QLabel):
    def __init__(self, parent=None):
        super().__init__(HINT, parent)
        self._tokens: list[tuple[float, int]] = []  # (end of step, tokens), two seconds' worth

    def show_frame(self, snap, records, source, cursor: int | None, model: str, engine,
                   state: str) -> None:
        """cursor: the step the user looks back at (None: the newest); engine: EngineInfo;
        state: what the engine is doing and what F5 does ("": nothing ran yet)."""
        rate = self._rate(records)
        if snap is None:
            return
        usage = (f"{snap.num_active_blocks}/{snap.num_blocks} used · {snap.num_cached_blocks} "
                 f"cached · {snap.num_free_blocks} free · step {snap.step} · hit "
                 f"{snap.token_hit_rate:.0%}")
        own = source.status_text(snap)
        if own is not None:  # an attached server
            self.setText(own)
            return
        if not source.live:
            self.setText(f"replay · {source.name} · {usage}")  # the name says the model
            return
        if cursor is not None:
            usage = f"history, newest step {source.step_range()[1]} (End follows live) · {usage}"
        elif engine is not None and engine.num_steps == 0:
            usage = f"{snap.num_blocks} blocks of {snap.block_size} tokens · {HINT}"
        else:
            usage += f" · {rate}"
        device = engine.device if engine is not None else "?"
        self.setText(f"{model} · {device} · {usage}" + (f" · {state}" if state else ""))

    def _rate(self, records) -> str:
        window = self._tokens
        window += [(r.start_s + r.wall_s, r.prefill_tokens + r.decode_tokens) for r in records]
        if window:
            self._tokens = window = [(t, n) for t, n in window if t > window[-1][0] - 2.0]
        span = window[-1][0] - window[0][0] if len(window) > 1 else 0
        return f"{sum(n for _, n in window) / span:.0f} tok/s" if span > 0 else "– tok/s"
