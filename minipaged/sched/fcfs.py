"""vLLM's policy: first-come-first-served continuous batching with preemption (vLLM paper §4.5).

Every step grows the running groups in arrival order, preempting the most recent arrivals when
blocks run out; if nobody was preempted, swapped groups come back before any new request is
admitted, and nobody overtakes the head of the waiting queue. The mechanics (admit, grow,
preempt, swap, the fit checks and the budget) are `minipaged.sched.base.Scheduler`'s.
"""

from __future__ import annotations

from collections import deque

from minipaged.sampling.sequence import SequenceStatus
from minipaged.sched.base import Scheduler
from minipaged.sched.output import SchedulerOutput, StepBudget


class FCFSScheduler(Scheduler):
    """First-come-first-served continuous batching with preemption (vLLM paper §4.5)."""

    def choose(self, now: float, out: SchedulerOutput, budget: StepBudget) -> None:
        """Running groups first (preempting the latest arrivals when blocks run out), then, if
        nobody was preempted, swapped ones, then new ones in arrival order."""
        self.schedule_running(out, budget)
        if not out.preempted:
            self._schedule_queue(SequenceStatus.SWAPPED, out, budget)
            if not self.swapped:
                self._schedule_queue(SequenceStatus.WAITING, out, budget)

    def schedule_running(self, out: SchedulerOutput, budget: StepBudget) -> None:
        """Grow every running group that fits the budget, in order; when blocks run out, the
        most recently arrived running group is preempted (possibly the one growing)."""
        queue = deque(self.running)
        while queue:
            group = queue.popleft()
            seqs = group.get_seqs(SequenceStatus.RUNNING)
            if not self.fits_budget(seqs, budget):
                continue  # stays running, keeps its blocks, waits for the next step
            while not self.can_grow(seqs):
                victim = queue.pop() if queue else group
                self.preempt(victim, out)
                if victim is group:
                    break
            else:
                self.run(group, out, budget, seqs)

    def _schedule_queue(
        self, status: SequenceStatus, out: SchedulerOutput, budget: StepBudget
    ) -> None:
        """Run the groups of the swapped or the waiting queue in order while the head fits
        (swapped back in, or admitted)."""
        queue = self.states[status].queue
        while queue:
            seqs = queue[0].get_seqs(status)
            if not self.fits_budget(seqs, budget) or not self.fits(seqs):
                return  # first come, first served: nobody overtakes the head of the queue
            self.run(queue[0], out, budget, seqs)
