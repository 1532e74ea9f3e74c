"""The schedulers of the systems PagedAttention is measured against (vLLM paper §6.1).

The vLLM paper (Kwon et al. SOSP'23) compares vLLM with

* **Orca (Max / Pow2 / Oracle)**: iteration-level scheduling like vLLM's, but each request's KV
  cache is one contiguous chunk reserved when the request is admitted;
* **FasterTransformer**: no iteration-level scheduling. A batch of up to B earliest requests
  is formed, B as large as memory allows with every row reserved for the maximum length, and
  runs to completion before the next batch is formed (static batching).

Their memory is `minipaged.kv.reservation.ReservationKVCacheManager`; their schedulers here are the
FCFS policy of the paged system with what differs: Orca announces each request's length to the
reservation manager when it arrives (a reservation is sized by it), and static batching forms a
batch only when none is running. `minipaged.sched.registry` builds them by name.
"""

from __future__ import annotations

from minipaged.kv.reservation import ReservationKVCacheManager
from minipaged.sampling.sequence import SequenceGroup, SequenceStatus
from minipaged.sched.base import PreemptionMode, SchedulerOutput, StepBudget
from minipaged.sched.fcfs import FCFSScheduler


class OrcaScheduler(FCFSScheduler):
    """Orca: FCFS iteration-level scheduling over contiguous reservations.

    The policy is `FCFSScheduler`'s, unchanged; `add` announces the request to the reservation
    manager, whose `can_allocate` then sizes the request's chunks. The expected output length is
    `max_tokens` (capped by the context): the oracle's knowledge when requests run with
    `ignore_eos`, as in the benchmarks.
    """

    kv_manager: ReservationKVCacheManager  # built so by `minipaged.sched.registry`

    def add(self, group: SequenceGroup) -> None:
        super().add(group)
        self._announce(group)

    def preempt(
        self, group: SequenceGroup, out: SchedulerOutput, mode: PreemptionMode | None = None
    ) -> None:
        """As every scheduler's; a group preempted by recomputation gave its reservation back,
        so it is announced again for its re-admission."""
        super().preempt(group, out, mode)
        if group in self.waiting:
            self._announce(group)

    def _announce(self, group: SequenceGroup) -> None:
        """Tell the reservation manager the request's lengths, by the sequence `admit` will
        allocate first."""
        prompt_len = group.seqs[0].get_prompt_len()
        output_len = min(group.sampling_params.max_tokens, self.config.max_model_len - prompt_len)
        first = group.get_unfinished_seqs()[0]
        self.kv_manager.expect(first.seq_id, prompt_len, output_len, group.max_width)


class StaticBatchScheduler(OrcaScheduler):
    """Static batching (FasterTransformer with a Triton-like batcher, vLLM paper §6.1).

    When no batch is running, up to `max_num_seqs` of the earliest waiting requests are admitted
    while the KV cache can hold them (with a "max" reservation manager: every row reserves the
    maximum length). The batch then runs -- prefills chunked within the token budget, one decode
    token per sequence per step -- and no request joins it until every one of its requests has
    finished.
    """

    def choose(self, now: float, out: SchedulerOutput, budget: StepBudget) -> None:
        if not self.running and not self.swapped:
            self._admit_batch()
        self.schedule_running(out, budget)

    def _admit_batch(self) -> None:
        """Move the earliest waiting requests into the (empty) running batch, FCFS."""
        num_seqs = 0
        while self.waiting:
            group = self.waiting[0]
            width = group.max_width
            if num_seqs + width > self.config.max_num_seqs:
                return
            if not self.can_admit(group.get_seqs(SequenceStatus.WAITING)):
                return
            self.admit(group)
            num_seqs += width
