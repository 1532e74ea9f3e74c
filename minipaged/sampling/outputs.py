"""What a request returns: vLLM's `RequestOutput`, `CompletionOutput` and request metrics.

Plain data, built by `SequenceGroup.to_request_output`, which holds back the end of a running
sample's text that may still become a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestMetrics:
    """Timestamps and counters of one request. Times are seconds on the clock of whoever drives
    the scheduler: the engine's `clock` (wall time unless given), the simulator's simulated
    time."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One generated continuation of a request (vLLM's class of the same name)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass
class RequestOutput:
    """The state of one request as returned to the user (vLLM's class of the same name)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
