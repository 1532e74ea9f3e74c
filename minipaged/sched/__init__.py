"""Layer 9 -- schedulers: FCFS continuous batching with preemption, FastServe's skip-join MLFQ
with proactive swapping, the Orca and static-batching baselines, the registry that builds them
by name, and the step-time cost model MLFQ predicts with.
"""

from __future__ import annotations

from minipaged.sched.base import Scheduler
from minipaged.sched.cost_model import CostModel, StepShape
from minipaged.sched.fcfs import FCFSScheduler
from minipaged.sched.mlfq import MLFQ_VARIANTS, MLFQConfig, MLFQVariant, SkipJoinMLFQScheduler
from minipaged.sched.output import (
    PreemptionMode,
    RequestRejectedError,
    ScheduledSequence,
    SchedulerConfig,
    SchedulerOutput,
)
from minipaged.sched.registry import SCHEDULERS, build_scheduler

__all__ = [
    "CostModel",
    "FCFSScheduler",
    "MLFQConfig",
    "MLFQVariant",
    "MLFQ_VARIANTS",
    "PreemptionMode",
    "RequestRejectedError",
    "SCHEDULERS",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SkipJoinMLFQScheduler",
    "StepShape",
    "build_scheduler",
]
