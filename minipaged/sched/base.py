"""Iteration-level scheduling over a KV cache manager: which sequences run in the next step.

`Scheduler` holds the mechanics every policy shares (vLLM paper §4.5): three queues by where a
group's blocks are (waiting: none, running: in the GPU pool, swapped: in the CPU pool), one
`QueueState` each, which is the only place that tells the three apart; admitting, growing,
preempting all-or-nothing by swapping to the CPU pool or by freeing the blocks for
recomputation (`PreemptionMode`, from the config), swapping back in; the fit checks; the
step's token budget (`StepBudget`); and `schedule(now)`, which asks the policy to fill the
step and hands the block tables the step needs to the engine on `SchedulerOutput`. A policy
only orders and chooses (`choose`): `minipaged.sched.fcfs.FCFSScheduler` (vLLM's),
`minipaged.sched.mlfq.SkipJoinMLFQScheduler` (FastServe's multi-level feedback queue), and the
baselines' `minipaged.sched.baselines`.

The scheduler is pure bookkeeping over `SequenceGroup`s and a `KVManager`
(`minipaged.kv.interface`) -- no tensors -- so the simulator drives the very code the engine
runs. A step's life: `schedule(now)` -> the engine runs the model, then `mark_computed(out)`,
samples, and calls `finish_step()`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from minipaged.kv.interface import KVManager
from minipaged.sampling.sequence import GroupMember, Sequence, SequenceGroup, SequenceStatus
from minipaged.sched.output import (
    PreemptionMode,
    RequestRejectedError,
    ScheduledSequence,
    SchedulerConfig,
    SchedulerOutput,
    StepBudget,
)

# The step's data types (`minipaged.sched.output`) are this module's vocabulary too.

# -- data types -----------------------------------------------------------------------------------


class QueueState(NamedTuple):
    """What one of a group's three states means to the scheduler: the queue holding the groups
    in it, whether such a group can compute its pending tokens now (`fits`), how many free GPU
    blocks that takes (`blocks_needed`), and the move that puts its blocks in the GPU pool
    first (`to_gpu`; none for a running group, whose blocks are there)."""

    queue: deque[SequenceGroup] | list[SequenceGroup]
    fits: Callable[[list[Sequence]], bool]
    blocks_needed: Callable[[list[Sequence]], int]
    to_gpu: Callable[[SequenceGroup, SchedulerOutput], None] | None


# -- the scheduler --------------------------------------------------------------------------------


class Scheduler(ABC):
    """The contract every scheduler keeps, and the mechanics shared by every policy: a policy
    implements `choose` and may extend the other methods, keeping their signatures (the
    engine calls `add`, `abort(request_id, status)`, `schedule`, `mark_computed`,
    `finish_step`, `fork_sequence` and `free_sequence` of any scheduler alike;
    tests/sched/test_contract.py checks every registered one).

    Invariant: every unfinished group is in exactly one queue, by where its blocks are --
    `waiting` (none: new, or preempted by recomputation), `running` (in the GPU pool; a policy
    may leave a running group out of a step, it keeps its blocks) or `swapped` (in the CPU
    pool) -- the queue of its sequences' status in `states`. Only the moves below (`_move`)
    change the queues and, through `kv_manager`, the block tables.
    """

    # Whether the policy predicts step times (`cost_model`), as skip-join MLFQ does.
    needs_cost_model = False
    # How the policy preempts when the config leaves it open (`preemption_mode` None); None
    # here is vLLM's rule: swap a group of several sequences, recompute a single one.
    default_preemption_mode: PreemptionMode | None = None

    def __init__(self, config: SchedulerConfig, kv_manager: KVManager) -> None:
        self.config = config
        self.kv_manager = kv_manager
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        # The one switch over a group's state; `groups()` yields the queues in this order.
        self.states: dict[SequenceStatus, QueueState] = {
            SequenceStatus.RUNNING: QueueState(
                self.running, self.can_grow, self.grow_blocks, None
            ),
            SequenceStatus.SWAPPED: QueueState(
                self.swapped, self.can_swap_in, self.swap_in_blocks, self.swap_in
            ),
            SequenceStatus.WAITING: QueueState(
                self.waiting, self.can_admit, self.admit_blocks,
                lambda group, _out: self.admit(group),
            ),
        }
        self.num_preemptions = 0
        self._now = 0.0

    # -- requests in and out ----------------------------------------------------------------------

    def check_request(self, group: SequenceGroup) -> None:
        """Reject at once a request that could never finish, whatever else is running."""
        prompt_len = group.seqs[0].get_prompt_len()
        if prompt_len >= self.config.max_model_len:
            raise RequestRejectedError(
                f"request {group.request_id}: prompt of {prompt_len} tokens leaves no room to "
                f"generate within the model's context of {self.config.max_model_len} tokens"
            )
        max_len = min(prompt_len + group.sampling_params.max_tokens, self.config.max_model_len)
        width = group.max_width
        field = "beam_width" if group.sampling_params.use_beam_search else "n"
        # A group's sequences sample together, a token each in one step, from its second
        # token on. Anything longer (a prompt, a recomputation) fits a step whole or in pieces
        # (`step_plan`).
        for limit in ("max_num_seqs", "max_num_batched_tokens"):
            if max_len - prompt_len > 1 and width > getattr(self.config, limit):
                raise RequestRejectedError(
                    f"request {group.request_id}: {field}={width} needs {width} sequences in "
                    f"one step but {limit}={getattr(self.config, limit)}"
                )
        # Admission, swap-in and re-admission all leave the watermark free: so must a request.
        kv = self.kv_manager
        needed = kv.blocks_for_request(prompt_len, max_len, width)
        usable = kv.num_gpu_blocks - kv.watermark_blocks
        if needed > usable:
            raise RequestRejectedError(
                f"request {group.request_id}: needs up to {needed} KV blocks of "
                f"{kv.block_size} tokens ({width} x up to {max_len} tokens) but the cache has "
                f"only {usable} usable ({kv.num_gpu_blocks} less the watermark); lower max_tokens "
                "or n, or enlarge the cache"
            )

    def add(self, group: SequenceGroup) -> None:
        self.check_request(group)
        self.waiting.append(group)

    def abort(
        self, request_id: str, status: SequenceStatus = SequenceStatus.FINISHED_ABORTED
    ) -> SequenceGroup | None:
        """Remove a request wherever it is, return its blocks, and end its unfinished
        sequences with `status`; None when it is unknown."""
        for state in self.states.values():
            for group in state.queue:
                if group.request_id == request_id:
                    state.queue.remove(group)
                    for seq in group.seqs:
                        if not seq.is_finished():
                            self._release(seq)
                            seq.status = status
                    return group
        return None

    def fork_sequence(self, group: SequenceGroup, parent: Sequence, child: Sequence) -> None:
        """Add `child` to `group`, sharing every block of `parent` (parallel sampling and beam
        search, vLLM paper §4.4): the sampler forks sequences, the scheduler their blocks."""
        self.kv_manager.fork(parent.seq_id, child.seq_id)
        group.add(child)

    def free_sequence(self, group: SequenceGroup, seq: Sequence) -> None:
        """Free `seq`'s blocks, if it has any, and remove it from `group` (a pruned beam)."""
        self._release(seq)
        group.remove(seq.seq_id)

    def queue_levels(self) -> dict[str, int]:
        """Each request's queue, for step records: empty for a policy without levels."""
        return {}

    def has_unfinished(self) -> bool:
        return any(state.queue for state in self.states.values())

    def groups(self) -> Iterator[SequenceGroup]:
        """Every unfinished group: the running ones, then the swapped, then the waiting."""
        for state in self.states.values():
            yield from state.queue

    # -- one step ---------------------------------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        """Choose this step's work; `now` is the clock of whoever drives the scheduler (wall
        time in the engine, simulated time in the simulator). Each scheduled sequence carries
        its block table as the step will find it."""
        self._now = now
        out = SchedulerOutput()
        config = self.config
        budget = StepBudget(
            config.max_num_batched_tokens, config.max_num_seqs, config.enable_chunked_prefill
        )
        self.choose(now, out, budget)
        return out

    @abstractmethod
    def choose(self, now: float, out: SchedulerOutput, budget: StepBudget) -> None:
        """The policy: fill `out` within `budget` by the moves below (`fits_budget` and `fits`
        say whether a group can run now, `run` runs it)."""

    def mark_computed(self, out: SchedulerOutput) -> list[GroupMember]:
        """Record that the step's forward pass computed (wrote the K/V of) its tokens; return
        the group and sequence of each item that samples, in plan order (the logits' rows).

        Full blocks become findable in the prefix cache only now, never before their K/V exist.
        A decode step computed every token of a sequence: its token list goes as it is.
        """
        members = self.resolve(out.scheduled)
        for item, (_, seq) in zip(out.scheduled, members, strict=True):
            seq.num_computed_tokens = n = item.start + len(item.token_ids)
            tokens = seq.token_ids if n == len(seq.token_ids) else seq.token_ids[:n]
            self.kv_manager.mark_computed(seq.seq_id, tokens)
        return [m for item, m in zip(out.scheduled, members, strict=True) if item.needs_logits]

    def resolve(self, items: Iterable[ScheduledSequence]) -> list[GroupMember]:
        """The running group and the sequence each scheduled item names (the plan holds ids;
        the scheduler owns the objects)."""
        groups = {group.request_id: group for group in self.running}
        return [GroupMember(g := groups[item.request_id], g.find(item.seq_id)) for item in items]

    def finish_step(self) -> list[SequenceGroup]:
        """Free the blocks of sequences that finished this step; return the finished groups.

        Call after the engine appended the sampled tokens and marked finished sequences.
        """
        finished, running = [], []
        for group in self.running:
            for seq in (done := [s for s in group.seqs if s.is_finished()]):
                self._release(seq)
            (finished if len(done) == len(group.seqs) else running).append(group)
        self.running[:] = running
        return finished

    # -- fit checks -------------------------------------------------------------------------------

    def fits(self, seqs: list[Sequence]) -> bool:
        """Whether a group can compute its pending tokens now, wherever its blocks are."""
        return self.states[seqs[0].status].fits(seqs)

    def blocks_needed(self, seqs: list[Sequence]) -> int:
        """Free GPU blocks a group needs before it can compute its pending tokens, shared
        blocks counted once (prefix-cache hits not counted: an upper bound for a waiting one)."""
        return self.states[seqs[0].status].blocks_needed(seqs)

    def can_grow(self, seqs: list[Sequence]) -> bool:
        """Whether every running sequence of a group gets the slots of its pending tokens. A
        sequence takes at most a block per pending token and a copy-on-write copy: with that
        many free (most decode steps) nothing needs counting."""
        free = self.kv_manager.num_free_blocks
        bound = sum([len(s.token_ids) - s.num_computed_tokens + 1 for s in seqs])
        return bound <= free or self.grow_blocks(seqs) <= free

    def grow_blocks(self, seqs: list[Sequence]) -> int:
        """GPU blocks a running group takes for the slots of its pending tokens."""
        kv = self.kv_manager
        return sum([kv.num_blocks_to_append(s.seq_id, num_tokens=len(s.token_ids)) for s in seqs])

    def can_swap_in(self, seqs: list[Sequence]) -> bool:
        """Whether a swapped group fits back in *and* can then take its pending tokens."""
        kv = self.kv_manager
        return kv.can_swap_in([s.seq_id for s in seqs]) and (
            self.swap_in_blocks(seqs) <= kv.num_free_blocks
        )

    def swap_in_blocks(self, seqs: list[Sequence]) -> int:
        """GPU blocks a swapped group takes to come back and take its pending tokens."""
        return self.kv_manager.num_blocks_to_swap_in({s.seq_id: s.get_len() for s in seqs})

    def can_admit(self, seqs: list[Sequence]) -> bool:
        """Whether admitting these waiting sequences leaves the watermark free."""
        kv = self.kv_manager
        if len(seqs) == 1:  # token ids let the manager count prefix-cache hits
            return kv.can_allocate(seqs[0].seq_id, seqs[0].token_ids)
        # Several sequences come back only after recomputation; `admit` shares their prompt's
        # full blocks, counted once, as `check_request` counted them.
        return kv.num_free_blocks - self.admit_blocks(seqs) >= kv.watermark_blocks

    def admit_blocks(self, seqs: list[Sequence]) -> int:
        """GPU blocks `admit` takes for these waiting sequences (no prefix hits counted)."""
        shared = self.shared_prompt_blocks(seqs)
        return shared + sum(self.kv_manager.num_blocks_for(s.get_len()) - shared for s in seqs)

    def shared_prompt_blocks(self, seqs: list[Sequence]) -> int:
        """Full prompt blocks that the sequences of one group share (none for a single one)."""
        return seqs[0].get_prompt_len() // self.kv_manager.block_size if len(seqs) > 1 else 0

    # -- the step's token budget ------------------------------------------------------------------

    def fits_budget(self, seqs: list[Sequence], budget: StepBudget) -> bool:
        """Whether what is left of the step's budget lets this group make progress now.

        With chunked prefill: a token for each sequence. Without: every pending token of the
        group, except for a group whose pending tokens no step could hold (samples or beams
        back from recomputation, prompt blocks shared): it runs in pieces, each sequence's
        tokens whole, as `step_plan` cuts them.
        """
        if len(seqs) > budget.seqs:
            return False
        if budget.chunked_prefill:
            return len(seqs) <= budget.tokens
        plan = self.step_plan(seqs, budget)
        pending = sum(s.get_len() - start for s, start in self._starts(seqs))
        if sum(n for _, n in plan) == pending:
            return True
        return bool(plan) and pending > self.config.max_num_batched_tokens

    def step_plan(self, seqs: list[Sequence], budget: StepBudget) -> list[tuple[Sequence, int]]:
        """How many tokens each of a group's sequences computes this step (those computing
        none left out), within `budget`; nothing is changed.

        With chunked prefill a sequence takes what is left of the budget, at most
        `long_prefill_token_threshold` tokens when that is set; without, all its pending tokens
        or none. After a re-admission the others read the prompt blocks the first one writes,
        so they wait for them. A group's sequences sample together: when not all of them reach
        their last token this step, those that do stop one short of it (beam search ranks all
        its beams at once; the group's samples stay in step).
        """
        starts = self._starts(seqs)
        if len(starts) == 1:  # most groups: nothing shared, nobody to keep in step
            seq, start = starts[0]
            n = self._tokens_within(len(seq.token_ids) - start, budget.tokens, budget)
            return [(seq, n)] if n > 0 and budget.seqs > 0 else []
        shared = self.shared_prompt_blocks(seqs) * self.kv_manager.block_size
        tokens, plan, complete = budget.tokens, [], True
        written = 0  # the prompt tokens the first sequence has computed after this step
        for i, (seq, start) in enumerate(starts):
            remaining = len(seq.token_ids) - start
            n = self._tokens_within(remaining, tokens, budget)
            if i == 0:
                written = start + n
            if n <= 0 or (i and written < shared) or len(plan) == budget.seqs:
                complete = False
                continue
            complete = complete and n == remaining
            plan.append((seq, start, n))
            tokens -= n
        if not complete:
            plan = [(s, start, n - (start + n == len(s.token_ids))) for s, start, n in plan]
        return [(s, n) for s, _, n in plan if n > 0]

    def _tokens_within(self, remaining: int, tokens: int, budget: StepBudget) -> int:
        """How many of a sequence's `remaining` pending tokens a step computes with `tokens`
        left: with chunked prefill what fits (at most `long_prefill_token_threshold`, when
        set), without all of them or none."""
        if budget.chunked_prefill:
            return min(remaining, tokens, self.config.long_prefill_token_threshold or remaining)
        return remaining if remaining <= tokens else 0

    def _starts(self, seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
        """Each sequence with the position its next step starts from; for a waiting group, as
        `admit` will set it (prompt blocks shared, prefix-cache hits not counted)."""
        if seqs[0].status is not SequenceStatus.WAITING:
            return [(s, s.num_computed_tokens) for s in seqs]
        shared = self.shared_prompt_blocks(seqs) * self.kv_manager.block_size
        return [(s, shared if i else 0) for i, s in enumerate(seqs)]

    # -- moves ------------------------------------------------------------------------------------

    def run(self, group: SequenceGroup, out: SchedulerOutput, budget: StepBudget,
            seqs: list[Sequence]) -> None:
        """Put a group's blocks in the GPU pool if they are not (admit or swap in), give its
        sequences (`seqs`: its unfinished ones) the slots of their pending tokens, and schedule
        what the budget allows. The caller checked `fits`."""
        if seqs[0].status is not SequenceStatus.RUNNING:
            self.states[seqs[0].status].to_gpu(group, out)
        kv = self.kv_manager
        for seq in seqs:
            out.copy += kv.append_slots(seq.seq_id, num_tokens=len(seq.token_ids))
        # Each share's block table is final here: no later move of the step touches a scheduled
        # group's blocks (preemption and swaps take groups not yet run).
        for seq, n in self.step_plan(seqs, budget):
            start = seq.num_computed_tokens
            out.scheduled.append(ScheduledSequence(  # needs_logits, is_prefill, block_table
                group.request_id, seq.seq_id, start, tuple(seq.token_ids[start:start + n]),
                start + n == len(seq.token_ids), n > 1 or start < seq.num_prompt_tokens,
                kv.block_table(seq.seq_id)))
            budget.take(n)
        if group.metrics.first_scheduled_time is None:
            group.metrics.first_scheduled_time = self._now

    def admit(self, group: SequenceGroup) -> None:
        """Waiting -> running: blocks for all tokens of each sequence (prefix hits included).

        The request's `num_cached_tokens` counts the prompt tokens found at its first admission
        only: a re-admission after recomputation finding its own blocks again is no prefix hit.
        """
        first_admission = group.metrics.first_scheduled_time is None
        seqs = group.get_unfinished_seqs()
        shared = self.shared_prompt_blocks(seqs) * self.kv_manager.block_size
        if shared:  # samples or beams back from recomputation: one copy of the prompt blocks
            first = seqs[0]
            cached = self.kv_manager.allocate(first.seq_id, first.token_ids[:shared])
            for seq in seqs[1:]:
                self.kv_manager.fork(first.seq_id, seq.seq_id)
        for i, seq in enumerate(seqs):
            if not shared:
                cached = self.kv_manager.allocate(seq.seq_id, seq.token_ids)
            seq.num_computed_tokens = shared if i and shared else cached  # `run` orders them
            if first_admission:
                group.metrics.num_cached_tokens += cached
        self._move(group, seqs, SequenceStatus.RUNNING)

    def swap_in(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Swapped -> running: copy the group's blocks back to the GPU pool (copies in
        `out`)."""
        seqs = group.get_seqs(SequenceStatus.SWAPPED)
        out.swap_in.extend(self.kv_manager.swap_in([s.seq_id for s in seqs]))
        self._move(group, seqs, SequenceStatus.RUNNING)

    def swap_out(self, group: SequenceGroup, out: SchedulerOutput) -> bool:
        """Running -> swapped: move the group's blocks to the CPU pool; False (nothing done)
        when the CPU pool cannot take them."""
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        ids = [s.seq_id for s in seqs]
        if not self.kv_manager.can_swap_out(ids):
            return False
        out.swap_out.extend(self.kv_manager.swap_out(ids))
        self._move(group, seqs, SequenceStatus.SWAPPED)
        return True

    def preemption_mode(self, group: SequenceGroup) -> PreemptionMode:
        """How `group` gives back its blocks when preempted: the config's `preemption_mode`,
        else the policy's `default_preemption_mode`, else vLLM's rule (swap a group of several
        running sequences, recompute a single one)."""
        mode = self.config.preemption_mode or self.default_preemption_mode
        if mode is not None:
            return mode
        several = len(group.get_seqs(SequenceStatus.RUNNING)) > 1
        return PreemptionMode.SWAP if several else PreemptionMode.RECOMPUTE

    def preempt(
        self, group: SequenceGroup, out: SchedulerOutput, mode: PreemptionMode | None = None
    ) -> None:
        """Take all of a running group's blocks back (all-or-nothing, vLLM paper §4.5), by
        `mode`, or by `preemption_mode(group)` when None.

        Swapping falls back to recomputation when the CPU pool is full; a group preempted by
        recomputation goes to the front of `waiting` and prefills prompt + output again when
        resumed.
        """
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        mode = mode or self.preemption_mode(group)
        if not (mode is PreemptionMode.SWAP and self.swap_out(group, out)):
            self._move(group, seqs, SequenceStatus.WAITING, front=True)
            for seq in seqs:
                self._release(seq)
                seq.reset_for_recompute()
        group.metrics.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(group.request_id)

    def _move(
        self, group: SequenceGroup, seqs: list[Sequence], to: SequenceStatus, front: bool = False
    ) -> None:
        """Move `group` from the queue of its sequences' state to the back (or `front`) of the
        queue of `to`, and give `seqs` that status: the one place a group changes queue."""
        self.states[seqs[0].status].queue.remove(group)
        for seq in seqs:
            seq.status = to
        queue = self.states[to].queue
        queue.insert(0 if front else len(queue), group)

    def _release(self, seq: Sequence) -> None:
        if seq.seq_id in self.kv_manager:
            self.kv_manager.free(seq.seq_id)


# What a registry or the simulator holds: builds a scheduler over a given KV manager.
SchedulerFactory = Callable[[SchedulerConfig, KVManager], Scheduler]
