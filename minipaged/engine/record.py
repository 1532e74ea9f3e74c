"""The record of one engine step, for step observers: profilers, benchmarks, notebooks.

`LLMEngine.add_step_observer` hands every observer a `StepRecord` after each step: the plan
the step executed (its `SchedulerOutput`: who computed which tokens over which blocks, which
blocks moved, who was preempted), when it ran on the engine's clock, and where its wall time
went. The simulator's steps are engine steps too, so its records are the same type.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from minipaged.sched.cost_model import StepShape, step_shape
from minipaged.sched.output import ScheduledSequence, SchedulerOutput

# -- data types -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepTimings:
    """Where one engine step's wall time went, in seconds (`time.perf_counter`)."""

    schedule_s: float  # scheduler.schedule
    forward_s: float  # the block movements and the forward pass (runner.execute)
    update_s: float  # everything after the forward pass: sampling, forks, stops, freeing blocks
    outputs_s: float  # the step's `RequestOutput`s, for whoever reads them
    total_s: float  # the whole step


@dataclass(frozen=True)
class StepRecord:
    """One step, as it happened.

    `start` / `end` are on the engine's clock (wall time, or a simulator's cost-model time);
    `timings` are wall time. `num_running` counts the requests holding device memory during the
    step; `levels` is each request's queue under an MLFQ scheduler (empty otherwise); `failed`
    the requests that failed on their own and ended with "error" while the others went on.
    """

    index: int
    start: float
    end: float
    plan: SchedulerOutput
    num_running: int = 0
    levels: Mapping[str, int] = field(default_factory=dict)
    failed: tuple[str, ...] = ()  # requests the step ended with "error" (their own fault)
    timings: StepTimings | None = None

    @property
    def scheduled(self) -> list[ScheduledSequence]:
        return self.plan.scheduled

    @property
    def request_ids(self) -> tuple[str, ...]:
        """The requests that computed tokens in this step, in batch order."""
        return tuple(dict.fromkeys(work.request_id for work in self.plan.scheduled))

    @property
    def num_batched_tokens(self) -> int:
        return self.plan.num_batched_tokens

    @property
    def shape(self) -> StepShape:
        return step_shape(self.plan.scheduled)
