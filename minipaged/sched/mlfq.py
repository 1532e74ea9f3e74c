"""FastServe's skip-join multi-level feedback queue with proactive KV swapping (Wu et al.).

Run-to-completion FCFS suffers head-of-line blocking: a long job at the head delays every short
one behind it. FastServe preempts at the granularity of one output token and schedules with a
multi-level feedback queue (MLFQ), which favours short jobs without knowing job lengths:

* **Queues** Q1..QK with quanta `q_i = base_quantum * quantum_ratio ** (i - 1)` seconds of
  iteration time (§4.1). A step's whole duration is charged to every job in its batch.
* **Skip-join** (§4.1): a new job joins the highest-priority queue whose quantum covers its
  predicted first-iteration (prefill) time, from a `CostModel`: a long prompt skips the queues
  it would be demoted from in the middle of its prefill.
* **Demotion**: a job that has used its queue's quantum moves to the back of a lower queue,
  at the end of a step that gave it a token (a chunked prefill is one FastServe iteration):
  the next queue, or, when the time it used exceeds that queue's quantum too (a long
  prefill in Q1 under naive MLFQ), the first queue whose quantum covers it -- where skip-join
  would have put it. Demoting one level only would leave a job that just received 300 ms of
  service ahead of jobs that received 50 ms.
* **Promotion**: a job not scheduled for longer than `starvation_bound` seconds moves to Q1,
  ahead of Q1's other jobs (promoted jobs in promotion order) until it is demoted again, so it
  runs in the very next step and keeps running until it has made progress.
* **Each step** fills the batch from the highest-priority queue down, first come first served
  within a queue, within the token budget and `max_num_seqs` (without chunked prefill a job's
  whole pending prefill must fit what is left of the budget). A job left out keeps its blocks.
* **Making room**: when a selected job needs blocks, resident jobs expected to run after it
  give theirs up, the one expected to run last first: swapped to the CPU pool, or freed for
  recomputation, by the scheduler config's `preemption_mode` (swapping unless it says
  otherwise: `default_preemption_mode`). A resident job growing by a block, or a job promoted
  for starvation, may evict any of them; a *new* job only jobs of strictly lower queues (no
  preemption among peers of a first-come-first-served queue); a job that already ran and was
  preempted comes back only when its blocks fit (or ahead of time, below), never by evicting
  others.
  Without this rule jobs would swap each other out and in every time a demotion reorders them,
  and on a full cache that churn costs more than the reordering gains (CHANGELOG.md).
* **Proactive swapping** (§4.2, `MLFQConfig.proactive_swapping`): after choosing the batch,
  keep at least `reserve_blocks` free GPU blocks (default: `max_num_seqs`, one new block per
  sequence of a full batch next step) by swapping out the jobs expected to run last, and swap
  in ahead of time the swapped jobs expected to run next when there is room beyond the
  reserve. These swaps serve later steps, so a server overlaps them with this step's compute
  (`SchedulerOutput.num_swap_blocks_ahead`). Jobs that preemption would recompute are not
  swapped ahead.

**Time.** The scheduler keeps no clock of its own: `schedule(now)` charges the previous step's
batch with `now - previous now`. That is exactly the step's duration when the driver calls
`schedule` back to back, as `LLMEngine.run_until_done` and the simulator do; a driver that
idles between steps with work pending charges the idle time too.

Ablation variants (FastServe §6.3, `MLFQ_VARIANTS`): naive MLFQ (every job enters Q1), fixed
priority (skip-join levels, no demotion or promotion), recomputation instead of swapping (the
preemption mode), reactive swapping (swap only when a selected job's allocation fails).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import NamedTuple

from minipaged.kv.interface import KVManager
from minipaged.sampling.sequence import Sequence, SequenceGroup, SequenceStatus
from minipaged.sched.base import (
    PreemptionMode,
    Scheduler,
    SchedulerConfig,
    SchedulerFactory,
    SchedulerOutput,
    StepBudget,
)
from minipaged.sched.cost_model import CostModel

# -- data types -----------------------------------------------------------------------------------


@dataclass
class MLFQConfig:
    """The multi-level feedback queue's parameters (defaults as FastServe's: 10 ms, x2)."""

    num_levels: int = 8
    base_quantum: float = 0.010  # seconds of iteration time in Q1
    quantum_ratio: float = 2.0
    starvation_bound: float | None = 5.0  # seconds without a step; None: never promote
    skip_join: bool = True  # False: naive MLFQ, every job enters Q1
    demotion: bool = True  # False (with starvation_bound None): fixed priority
    # Keep a reserve of free blocks and swap out/in ahead of time (FastServe §4.2); False:
    # reactive, swap out only when a selected job cannot get its blocks.
    proactive_swapping: bool = True
    reserve_blocks: int | None = None  # K free GPU blocks to keep; None: max_num_seqs

    @classmethod
    def sized_to(cls, cost_model: CostModel, **overrides: object) -> MLFQConfig:
        """Quanta sized to a cost model: Q1's quantum is the shortest iteration (one decode of
        one sequence), as FastServe sets it (§4.1, §6); `overrides` set any other field."""
        settings = {"base_quantum": cost_model.min_iteration_time, **overrides}
        return cls(**settings)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        if self.num_levels < 1:
            raise ValueError(f"num_levels must be >= 1, got {self.num_levels}")
        if self.base_quantum <= 0:
            raise ValueError(f"base_quantum must be > 0 seconds, got {self.base_quantum}")
        if self.quantum_ratio < 1:
            raise ValueError(f"quantum_ratio must be >= 1, got {self.quantum_ratio}")
        if self.starvation_bound is not None and self.starvation_bound <= 0:
            raise ValueError(f"starvation_bound must be > 0 seconds, got {self.starvation_bound}")
        if self.reserve_blocks is not None and self.reserve_blocks < 0:
            raise ValueError(f"reserve_blocks must be >= 0, got {self.reserve_blocks}")

    def quantum(self, level: int) -> float:
        """The quantum of queue `level` (0-based: level 0 is Q1)."""
        return self.base_quantum * self.quantum_ratio**level


@dataclass
class JobState:
    """Where a job stands in the feedback queue."""

    level: int  # 0 = Q1, the highest priority
    order: int  # position within its queue: smaller runs first
    used: float = 0.0  # iteration time used in its current queue
    last_served: float = 0.0  # end of its last step (its arrival before the first)
    promoted: bool = False  # promoted for starvation and not demoted since: ahead in Q1
    entry_level: int = 0  # the level skip-join chose


# -- the scheduler --------------------------------------------------------------------------------


class SkipJoinMLFQScheduler(Scheduler):
    """Skip-join MLFQ with proactive swapping (FastServe §4); see the module docstring."""

    needs_cost_model = True
    default_preemption_mode = PreemptionMode.SWAP  # FastServe swaps every preempted job

    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVManager,
        mlfq: MLFQConfig | None = None,
        cost_model: CostModel | None = None,
    ) -> None:
        super().__init__(config, kv_manager)
        self.mlfq = dataclasses.replace(mlfq) if mlfq is not None else MLFQConfig()
        self.cost_model = cost_model
        self.jobs: dict[str, JobState] = {}
        self.num_demotions = 0
        self.num_promotions = 0
        self.num_swap_blocks_ahead = 0  # over all steps
        self._orders = itertools.count()
        self._last_batch: list[SequenceGroup] = []
        self._last_sampled: set[str] = set()  # groups of the last batch that got a token
        self._last_now: float | None = None

    @property
    def reserve_blocks(self) -> int:
        reserve = self.mlfq.reserve_blocks
        return self.config.max_num_seqs if reserve is None else reserve

    # -- requests in and out -----------------------------------------------------------------------

    def add(self, group: SequenceGroup) -> None:
        level = self.entry_level(group.seqs[0].get_prompt_len())
        super().add(group)  # checked, then queued: the job state is written only once it is
        self.jobs[group.request_id] = JobState(
            level, next(self._orders), last_served=group.arrival_time, entry_level=level
        )

    def entry_level(self, prompt_len: int) -> int:
        """Skip-join (§4.1): the first queue whose quantum covers the predicted prefill time."""
        if not self.mlfq.skip_join:
            return 0
        if self.cost_model is None:
            raise ValueError(
                "skip-join MLFQ needs a cost model to predict prefill times: pass cost_model= "
                "(e.g. CostModel.profile(engine)) or use MLFQConfig(skip_join=False)"
            )
        return self.level_covering(self.cost_model.prefill_time(prompt_len))

    def level_covering(self, seconds: float) -> int:
        """The first queue whose quantum is at least `seconds` (the last queue if none is)."""
        levels = range(self.mlfq.num_levels)
        return next((lv for lv in levels if self.mlfq.quantum(lv) >= seconds), levels[-1])

    def abort(
        self, request_id: str, status: SequenceStatus = SequenceStatus.FINISHED_ABORTED
    ) -> SequenceGroup | None:
        self.jobs.pop(request_id, None)  # nothing to pop for an unknown request
        return super().abort(request_id, status)

    def finish_step(self) -> list[SequenceGroup]:
        finished = super().finish_step()
        for group in finished:
            self.jobs.pop(group.request_id, None)
        return finished

    def queue_levels(self) -> dict[str, int]:
        return {request_id: job.level for request_id, job in self.jobs.items()}

    def priority_order(self) -> list[SequenceGroup]:
        """Every unfinished job, the one expected to run first first (promoted jobs lead Q1)."""

        def key(group: SequenceGroup) -> tuple[int, bool, int]:
            job = self.jobs[group.request_id]
            return (job.level, not job.promoted, job.order)

        return sorted(self.groups(), key=key)

    # -- one step -------------------------------------------------------------------------------

    def choose(self, now: float, out: SchedulerOutput, budget: StepBudget) -> None:
        """Charge the previous step, promote starving jobs, fill the batch by priority, then
        swap ahead of time (proactive policy)."""
        self._charge_previous_step(now)
        self._promote_starving(now)
        order = self.priority_order()
        selected: list[SequenceGroup] = []
        for index, group in enumerate(order):
            if budget.exhausted:
                break
            seqs = group.get_unfinished_seqs()
            if not self.fits_budget(seqs, budget):
                continue
            if not self._make_room(group, seqs, order[index + 1 :], out):
                continue
            self.run(group, out, budget, seqs)
            selected.append(group)
        if self.mlfq.proactive_swapping:
            self._swap_ahead(order, selected, out)
        self._last_batch = [group for group, _ in self.resolve(out.scheduled)]
        self._last_sampled = {s.request_id for s in out.scheduled if s.needs_logits}
        self._last_now = now

    # -- feedback: demotion and promotion ----------------------------------------------------------

    def _charge_previous_step(self, now: float) -> None:
        """Charge the last step's duration to its jobs; demote those out of quantum."""
        if self._last_now is None:
            return
        duration = max(0.0, now - self._last_now)
        for group in dict.fromkeys(self._last_batch):  # a group once, however many seqs
            job = self.jobs.get(group.request_id)
            if job is None:  # finished or aborted
                continue
            job.used += duration
            job.last_served = now
            if self._should_demote(group, job):
                self._requeue(job, max(job.level + 1, self.level_covering(job.used)))
                self.num_demotions += 1
        self._last_batch = []

    def _should_demote(self, group: SequenceGroup, job: JobState) -> bool:
        """Out of quantum, at the end of a step that gave the job a token. Like FastServe's
        one-iteration prefill, a chunked prefill (or recomputation) is not cut short by demotion:
        every job that reaches the front makes progress, so recomputation cannot livelock."""
        if not self.mlfq.demotion or job.level == self.mlfq.num_levels - 1:
            return False
        return group.request_id in self._last_sampled and job.used >= self.mlfq.quantum(job.level)

    def _promote_starving(self, now: float) -> None:
        """Jobs not served for longer than the starvation bound go to the front of Q1."""
        bound = self.mlfq.starvation_bound
        if bound is None:
            return
        starving = sorted(
            (job.last_served, request_id)
            for request_id, job in self.jobs.items()
            if not job.promoted and now - job.last_served > bound
        )
        for _, request_id in starving:  # the longest waiting first
            self._requeue(self.jobs[request_id], 0, promoted=True)
            self.num_promotions += 1

    def _requeue(self, job: JobState, level: int, promoted: bool = False) -> None:
        """Put `job` at the back of queue `level` with the whole of its quantum to use (a
        `promoted` job at the back of the promoted jobs, ahead of the others)."""
        job.level, job.used, job.promoted = level, 0.0, promoted
        job.order = next(self._orders)

    # -- memory: making room, bringing in, swapping ahead ------------------------------------------

    def _make_room(
        self,
        group: SequenceGroup,
        seqs: list[Sequence],
        lower: list[SequenceGroup],
        out: SchedulerOutput,
    ) -> bool:
        """Free GPU blocks for `group` by preempting resident jobs it may evict, last first;
        False (nobody preempted) when even all of them would not make enough room.

        A resident or promoted (starving) job evicts any job behind it; a new job only jobs of
        strictly lower queues; a preempted job waits until its blocks fit (module docstring)."""
        if self.fits(seqs):
            return True
        job = self.jobs[group.request_id]
        resident = [g for g in lower if g in self.running]
        if job.promoted or seqs[0].status is SequenceStatus.RUNNING:
            victims = resident
        elif group.metrics.first_scheduled_time is None:  # new: never ran
            victims = [g for g in resident if self.jobs[g.request_id].level > job.level]
        else:
            return False
        if out.swap_in and any(self.preemption_mode(g) is PreemptionMode.SWAP for g in victims):
            # The runner copies every swap-out of a step before its swap-ins, and a swap-in
            # frees CPU blocks that a later swap-out would reuse: no swap-out after a swap-in.
            return False
        held = sum(
            len(self.kv_manager.block_table(s.seq_id))
            for g in victims
            for s in g.get_seqs()
            if s.seq_id in self.kv_manager
        )
        if self.kv_manager.num_free_blocks + held < self.blocks_needed(seqs):
            return False
        while victims and not self.fits(seqs):
            self.preempt(victims.pop(), out)
        return self.fits(seqs)

    def _swap_ahead(
        self, order: list[SequenceGroup], selected: list[SequenceGroup], out: SchedulerOutput
    ) -> None:
        """Proactive swapping (§4.2): restore the free-block reserve by swapping out the
        resident jobs expected to run last (those preemption would swap), then swap in the
        swapped jobs expected to run next while the reserve stays free."""
        kv, reserve = self.kv_manager, self.reserve_blocks
        chosen = set(map(id, selected))
        idle = [g for g in order if id(g) not in chosen]
        moved = len(out.swap_in) + len(out.swap_out)
        for group in reversed(idle):
            if kv.num_free_blocks >= reserve or out.swap_in:  # no swap-out after a swap-in
                break
            if group not in self.running or self.preemption_mode(group) is not PreemptionMode.SWAP:
                continue
            if not self.swap_out(group, out):
                break  # the CPU pool is full
        for group in idle:
            if group not in self.swapped:
                continue
            seqs = group.get_seqs(SequenceStatus.SWAPPED)
            if not self.can_swap_in(seqs):
                break
            if kv.num_free_blocks - self.blocks_needed(seqs) < reserve:
                break
            self.swap_in(group, out)
        ahead = len(out.swap_in) + len(out.swap_out) - moved
        out.num_swap_blocks_ahead += ahead
        self.num_swap_blocks_ahead += ahead


# -- the variants (FastServe §6.3's ablation) -----------------------------------------------------


def check_variant_mode(
    fixed: PreemptionMode | None, mode: PreemptionMode | str | None, scheduler: str
) -> None:
    """A `ValueError` when a `scheduler` that stands for the preemption mode `fixed` (None: for
    none) is asked for the other one, `mode` ("mlfq-recompute" with "swap")."""
    if fixed is not None and mode is not None and PreemptionMode(mode) is not fixed:
        raise ValueError(
            f"preemption_mode must be None or {fixed.value!r} for {scheduler}, which preempts "
            f"by {fixed.value}; got {PreemptionMode(mode).value!r}"
        )


def mlfq_factory(
    mlfq: MLFQConfig,
    cost_model: CostModel | None = None,
    preemption_mode: PreemptionMode | str | None = None,
) -> SchedulerFactory:
    """A `(SchedulerConfig, KVManager) -> scheduler` constructor with these settings (what
    `minipaged.sched.registry` holds, and what `minipaged.sim.simulator` takes).
    `preemption_mode`, when given, is the mode the scheduler config gets (a config naming
    another one is an error)."""
    if preemption_mode is None:
        return functools.partial(SkipJoinMLFQScheduler, mlfq=mlfq, cost_model=cost_model)
    mode = PreemptionMode(preemption_mode)

    def build(config: SchedulerConfig, kv_manager: KVManager) -> SkipJoinMLFQScheduler:
        check_variant_mode(mode, config.preemption_mode, "this MLFQ variant")
        config = dataclasses.replace(config, preemption_mode=mode)
        return SkipJoinMLFQScheduler(config, kv_manager, mlfq, cost_model)

    return build


class MLFQVariant(NamedTuple):
    """One setting of FastServe's ablation (§6.3) by name: the feedback queue's parameters, and
    the preemption mode the variant stands for (None: the scheduler config's)."""

    mlfq: MLFQConfig
    preemption_mode: PreemptionMode | None = None

    def factory(self, cost_model: CostModel | None = None, **overrides: object) -> SchedulerFactory:
        """`mlfq_factory` of this variant; `overrides` replace fields of its `MLFQConfig`."""
        mlfq = dataclasses.replace(self.mlfq, **overrides) if overrides else self.mlfq
        return mlfq_factory(mlfq, cost_model, self.preemption_mode)


MLFQ_VARIANTS: dict[str, MLFQVariant] = {
    "mlfq": MLFQVariant(MLFQConfig()),
    "mlfq-naive": MLFQVariant(MLFQConfig(skip_join=False)),
    "mlfq-fixed": MLFQVariant(MLFQConfig(demotion=False, starvation_bound=None)),
    "mlfq-recompute": MLFQVariant(MLFQConfig(), PreemptionMode.RECOMPUTE),
    "mlfq-reactive": MLFQVariant(MLFQConfig(proactive_swapping=False)),
}
