"""The engine process as a frame source: its frames stream in; past steps come from the session
it always records."""

from __future__ import annotations

from kvscope.app.frames import Frame
from kvscope.app.sources.base import MAX_EVENTS, FrameSource
from kvscope.app.sources.replay import ReplaySource
from kvscope.engine.explain import MissExplanation
from kvscope.lab.capacity import InvalidConfigError, KVShape, format_parts
from kvscope.sessions import SessionError, SessionReader


def _parts(info) -> tuple:
    """The engine format's bytes per token and layer by part (data, scales), from its model's
    config; () where the config does not say."""
    try:
        return format_parts(KVShape.from_hf_dict(info.model_config), info.kv_format,
                            info.block_size)
    except (InvalidConfigError, ValueError, KeyError, TypeError):
        return ()


class LiveSource(FrameSource):
    """The engine process. Its frames stream in; past steps come from the session it always
    records (`EngineInfo.history_path`)."""

    live = True

    def __init__(self, client):
        self.client = client
        self.name = "live"
        self._history: ReplaySource | None = None
        self.reset()

    def reset(self) -> None:
        """A new engine: nothing shown yet."""
        if self._history is not None:
            self._history.close()
        self._history = None
        self.latest = Frame()  # the newest state, and every record and event so far
        self.latest.requests = []

    def take_frame(self) -> Frame | None:
        frame = self.client.take_frame()
        if frame is not None:
            self.latest.merge(frame)
            del self.latest.events[:-MAX_EVENTS]
        return frame

    def everything(self) -> Frame:
        """The newest state with every record and event so far (to show this source again)."""
        f = self.latest
        return Frame(f.snapshot, f.evicted, list(f.records), list(f.events), f.requests)

    def newest(self) -> Frame:
        """The newest state, nothing new."""
        return Frame(self.latest.snapshot, self.latest.evicted, requests=self.latest.requests)

    def step_range(self) -> tuple[int, int] | None:
        records = self.latest.records
        return (records[0].step, records[-1].step) if records else None

    def history(self) -> ReplaySource:
        info = self.client.info
        if info is None or info.history_path is None:
            raise SessionError("this engine keeps no history: only the newest step is shown")
        if self._history is None or str(self._history.reader.path) != info.history_path:
            if self._history is not None:
                self._history.close()
            self._history = ReplaySource(SessionReader(info.history_path))
        return self._history

    def frame_at(self, step: int) -> Frame:
        history = self.history()
        try:
            return history.frame_at(step)
        except SessionError:
            written = history.step_range()
            if written is None or step > written[1]:  # the recorder commits every ~0.25 s
                raise SessionError(f"step {step} is not in the engine's history yet; try again "
                                   "in a moment") from None
            raise

    def explain(self, request_id: int, step: int | None) -> MissExplanation | None:
        info = self.client.info
        if step is None and info is not None:
            return info.explanations.get(request_id)
        return self.history().explain(request_id, step)

    def settings(self) -> dict:
        info = self.client.info
        if info is None:
            return {}
        return {"model": info.model_name, "num_blocks": info.num_blocks,
                "block_size": info.block_size, "kv_cache_dtype": info.kv_format,
                "kv_bytes_per_token": info.kv_bytes_per_token, "kv_format": info.kv_format,
                "kv_parts": _parts(info)}

    def close(self) -> None:
        self.reset()
