"""The paper's naive MLFQ: a multi-level feedback queue that demotes one level at a time.

FastServe (Wu et al.) compares skip-join MLFQ against a naive MLFQ in which every job enters
the highest-priority queue and, having used a queue's quantum, moves down **one** level, as
FastServe's own scheduler code does. minipaged's `mlfq-naive` (`minipaged.sched.mlfq`) demotes
a job straight to the first queue whose quantum covers the time it used, so that a job whose
one long prefill overran several quanta lands where skip-join would have put it (which of the
two is harder to beat depends on the trace: notebook 07 measures both). `OneLevelDemotionMLFQ`
is the paper's: after the scheduler's own
demotions it moves every demoted job back up to one level below where it was. It uses only the
scheduler's public state (`jobs`, `priority_order`), which the scheduler reads right after
charging the previous step and before choosing the next batch.
"""

from __future__ import annotations

import functools

from minipaged.kv.interface import KVManager
from minipaged.sampling.sequence import SequenceGroup
from minipaged.sched.base import SchedulerConfig, SchedulerFactory
from minipaged.sched.cost_model import CostModel
from minipaged.sched.mlfq import MLFQConfig, SkipJoinMLFQScheduler

__all__ = ["OneLevelDemotionMLFQ", "one_level_factory"]


class OneLevelDemotionMLFQ(SkipJoinMLFQScheduler):
    """MLFQ whose demotions go one level at a time (module docstring)."""

    def __init__(self, config: SchedulerConfig, kv_manager: KVManager,
                 mlfq: MLFQConfig | None = None, cost_model: CostModel | None = None) -> None:
        super().__init__(config, kv_manager, mlfq, cost_model)
        self.seen_levels: dict[str, int] = {}  # each job's level when last ordered

    def priority_order(self) -> list[SequenceGroup]:
        for request_id, job in self.jobs.items():
            before = self.seen_levels.get(request_id, job.entry_level)
            if not job.promoted and job.level > before + 1:
                job.level = before + 1
        self.seen_levels = {request_id: job.level for request_id, job in self.jobs.items()}
        return super().priority_order()


def one_level_factory(mlfq: MLFQConfig, cost_model: CostModel | None = None) -> SchedulerFactory:
    """A `(SchedulerConfig, KVManager) -> scheduler` constructor for the simulator, as
    `minipaged.sched.mlfq.mlfq_factory` makes for the scheduler's own variants."""
    return functools.partial(OneLevelDemotionMLFQ, mlfq=mlfq, cost_model=cost_model)
