"""Per-step and per-request timing records. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepRecord:
    step: int
    start_s: float  # monotonic time the step began
    wall_s: float = 0.0  # the whole step: scheduling, forward passes, sampling
    prefill_s: float = 0.0  # forward time of the prefill batch (GPU time on CUDA)
    decode_s: float = 0.0  # forward time of the decode batch (GPU time on CUDA)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    batch_size: int = 0  # sequences in this step's forward passes
    num_waiting: int = 0
    num_running: int = 0
    num_free_blocks: int = 0
    num_active_blocks: int = 0
    num_cached_blocks: int = 0
    hit_tokens: int = 0  # prompt tokens served from the cache by admissions in this step
    query_tokens: int = 0  # prompt tokens looked up by first admissions in this step
    num_preempted: int = 0
    warmup: bool = False  # one of the first steps of a fresh engine: timings are not typical
    # KV-cache groups (kv_groups): blocks held by requests in each group after the step (empty:
    # not known, e.g. a session from before groups: one group, num_active_blocks), and blocks
    # released out of a sliding window during the step (its out_of_window events' blocks)
    group_blocks: tuple[int, ...] = ()
    window_freed_blocks: int = 0
    # The host tier (host_tier): blocks copied device -> host and host -> device before this
    # step's forward pass, and the copies' time (a host sync on CUDA: timed on the host)
    offloaded_blocks: int = 0
    loaded_blocks: int = 0
    transfer_s: float = 0.0


@dataclass
class RequestMetrics:
    arrival_s: float
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0  # of cached_tokens, those loaded back from the host tier
    num_preemptions: int = 0

    @property
    def output_tokens(self) -> int:
        return len(self.token_times_s)

    @property
    def queue_s(self) -> float | None:
        """Arrival to first scheduled."""
        return None if self.first_scheduled_s is None else self.first_scheduled_s - self.arrival_s

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: arrival to the first output token."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: gaps between consecutive output tokens."""
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (last - first) / (n - 1)."""
        t = self.token_times_s
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.arrival_s
