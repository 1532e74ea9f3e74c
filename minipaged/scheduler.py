"""Iteration-level scheduling over a paged KV cache: which sequences run in the next step.

`FCFSScheduler` is vLLM's policy (vLLM paper §4.5): requests are served first-come-first-served;
every step packs decodes and (chunked) prefills into one flat batch within a token budget; when
blocks run out, the most recently arrived group is preempted all-or-nothing, by swapping its blocks
to host memory or by freeing them and recomputing later; swapped groups come back before any new
request is admitted. The scheduler is pure bookkeeping over `SequenceGroup`s and the
`KVCacheManager` (no tensors), so the simulator drives the very same code as the engine.

`Scheduler` holds the mechanics every policy shares -- the three queues by where a group's
blocks are (waiting: none, running: on the device, swapped: on the host), admitting, growing,
preempting by swap or recomputation, swapping back in, and the step's token budget -- and
leaves the policy (who runs, who is preempted) to its subclasses: `FCFSScheduler` here,
`minipaged.mlfq.SkipJoinMLFQScheduler` for FastServe's multi-level feedback queue.

A step's life: `schedule(now)` -> the engine runs the model (`mark_computed`) and samples ->
`finish_step()`.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum

from minipaged.kv_cache import KVCacheManager
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus

# -- data types -----------------------------------------------------------------------------------


class PreemptionMode(str, Enum):
    """How a preempted group gives back its blocks (vLLM paper §4.5)."""

    RECOMPUTE = "recompute"  # free the blocks; later prefill prompt + generated tokens again
    SWAP = "swap"  # copy the blocks to the host pool; later copy them back


@dataclass
class SchedulerConfig:
    """The limits of one step, and the preemption policy."""

    max_num_batched_tokens: int = 2048  # tokens computed in one step (prefill chunks + decodes)
    max_num_seqs: int = 64  # sequences in one step
    max_model_len: int = 2048  # context length: prompt + output
    enable_chunked_prefill: bool = True
    # None: recompute a single sequence, swap a group of several (parallel sampling, beams),
    # as vLLM does; swapping falls back to recomputation when the host pool is full.
    preemption_mode: PreemptionMode | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
        if self.preemption_mode is not None:
            self.preemption_mode = PreemptionMode(self.preemption_mode)


@dataclass
class ScheduledSequence:
    """One sequence in a step: compute its tokens `[start, start + num_new_tokens)`."""

    seq: Sequence
    group: SequenceGroup
    start: int
    num_new_tokens: int

    @property
    def token_ids(self) -> list[int]:
        return self.seq.get_token_ids()[self.start : self.start + self.num_new_tokens]

    @property
    def needs_logits(self) -> bool:
        """True when this step computes the sequence's last known token: it samples a new one."""
        return self.start + self.num_new_tokens == self.seq.get_len()

    @property
    def is_prefill(self) -> bool:
        return self.num_new_tokens > 1 or self.start < self.seq.get_prompt_len()


@dataclass
class SchedulerOutput:
    """What one step computes and which block movements come first (DESIGN.md)."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted: list[SequenceGroup] = field(default_factory=list)

    # Blocks of `swap_in` / `swap_out` moved ahead of time for groups not in this step's batch
    # (proactive swapping, FastServe §4.2): a server overlaps them with the forward pass.
    num_swap_blocks_ahead: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.swap_in or self.swap_out or self.copy)


@dataclass
class _Budget:
    """What is left of a step's token and sequence budget."""

    tokens: int
    seqs: int

    def fits(self, seqs: list[Sequence], tokens_each: int) -> bool:
        return len(seqs) <= self.seqs and len(seqs) * tokens_each <= self.tokens

    def take(self, tokens: int, seqs: int = 1) -> None:
        self.tokens -= tokens
        self.seqs -= seqs


class RequestRejectedError(ValueError):
    """A request that can never be served: too long for the model or for the whole KV cache."""


# -- the scheduler --------------------------------------------------------------------------------


class Scheduler:
    """The mechanics shared by every policy; subclasses implement `schedule(now)`.

    Invariant: every unfinished group is in exactly one queue, by where its blocks are --
    `waiting` (none: new, or preempted by recomputation), `running` (on the device; a policy
    may leave a running group out of a step, it keeps its blocks) or `swapped` (on the host).
    """

    # Whether the engine must give the scheduler a `cost_model` (predicted step times) first.
    needs_cost_model = False

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        self.num_preemptions = 0
        self._now = 0.0

    # -- requests in and out ----------------------------------------------------------------------

    def check_request(self, group: SequenceGroup) -> None:
        """Reject at once a request that could never finish, whatever else is running."""
        seq = group.seqs[0]
        prompt_len = seq.get_prompt_len()
        if prompt_len >= self.config.max_model_len:
            raise RequestRejectedError(
                f"request {group.request_id}: prompt of {prompt_len} tokens leaves no room to "
                f"generate within the model's context of {self.config.max_model_len} tokens"
            )
        block_size = self.kv_cache.block_size
        max_len = min(prompt_len + group.sampling_params.max_tokens, self.config.max_model_len)
        width = group.max_width
        # The prompt's full blocks are shared by every sample; the rest of each is its own.
        shared = prompt_len // block_size if width > 1 else 0
        needed = shared + width * (math.ceil(max_len / block_size) - shared)
        if needed > self.kv_cache.num_blocks:
            raise RequestRejectedError(
                f"request {group.request_id}: needs up to {needed} KV blocks of {block_size} "
                f"tokens ({width} x up to {max_len} tokens) but the cache has only "
                f"{self.kv_cache.num_blocks}; lower max_tokens or n, or enlarge the cache"
            )

    def add(self, group: SequenceGroup) -> None:
        self.check_request(group)
        self.waiting.append(group)

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Remove a request wherever it is, return its blocks; None when it is unknown."""
        for queue in (self.waiting, self.running, self.swapped):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    for seq in group.seqs:
                        if not seq.is_finished():
                            self._release(seq)
                            seq.status = SequenceStatus.FINISHED_ABORTED
                    return group
        return None

    def fork_sequence(self, group: SequenceGroup, parent: Sequence, child: Sequence) -> None:
        """Add `child` to `group`, sharing every block of `parent` (parallel sampling and beam
        search, vLLM paper §4.4): the sampler forks sequences, the scheduler their blocks."""
        self.kv_cache.fork(parent.seq_id, child.seq_id)
        group.add(child)

    def free_sequence(self, group: SequenceGroup, seq: Sequence) -> None:
        """Free `seq`'s blocks, if it has any, and remove it from `group` (a pruned beam)."""
        self._release(seq)
        group.remove(seq.seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def groups(self) -> Iterator[SequenceGroup]:
        yield from self.running
        yield from self.swapped
        yield from self.waiting

    # -- one step -------------------------------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        """Choose this step's work. `now` is the clock of whoever drives the scheduler: wall
        time in the engine, simulated time in the simulator."""
        raise NotImplementedError

    def mark_computed(self, out: SchedulerOutput) -> None:
        """Record that the step's forward pass computed (wrote the K/V of) its tokens.

        Full blocks become findable in the prefix cache only now, never before their K/V exist.
        """
        for item in out.scheduled:
            item.seq.num_computed_tokens = item.start + item.num_new_tokens
            self.kv_cache.mark_computed(item.seq.seq_id, item.seq.num_computed_tokens)

    def finish_step(self) -> list[SequenceGroup]:
        """Free the blocks of sequences that finished this step; return the finished groups.

        Call after the engine appended the sampled tokens and marked finished sequences.
        """
        for group in self.running:
            for seq in group.seqs:
                if seq.is_finished():
                    self._release(seq)
        finished = [g for g in self.running if g.is_finished()]
        self.running = [g for g in self.running if not g.is_finished()]
        return finished

    # -- helpers ----------------------------------------------------------------------------------

    def _can_append(self, seqs: Iterable[Sequence]) -> bool:
        """Whether every sequence of a group can get the slots of its pending tokens at once."""
        needed = sum(
            self.kv_cache.num_blocks_to_append(
                s.seq_id, s.get_len() - self.kv_cache.num_tokens(s.seq_id)
            )
            for s in seqs
        )
        return needed <= self.kv_cache.num_free_blocks

    def _can_swap_in(self, seqs: list[Sequence]) -> bool:
        """Whether a swapped group fits back in *and* can then take its pending tokens."""
        kv = self.kv_cache
        if not kv.can_swap_in([s.seq_id for s in seqs]):
            return False
        tables = {s.seq_id: kv.block_table(s.seq_id) for s in seqs}
        uses = Counter(block for table in tables.values() for block in table)
        growth = 0
        for seq in seqs:
            cached, wanted = kv.num_tokens(seq.seq_id), seq.get_len()
            growth += kv.num_blocks_for(wanted) - kv.num_blocks_for(cached)
            last_block_shared = uses[tables[seq.seq_id][-1]] > 1
            if wanted > cached and cached % kv.block_size and last_block_shared:
                growth += 1  # at most one copy-on-write copy
        return kv.num_free_blocks - len(uses) - growth >= 0

    def _can_allocate(self, seqs: list[Sequence]) -> bool:
        """Whether admitting these waiting sequences leaves the watermark free."""
        if len(seqs) == 1:  # token ids let the manager count prefix-cache hits
            return self.kv_cache.can_allocate(seqs[0].get_token_ids())
        needed = sum(self.kv_cache.num_blocks_for(s.get_len()) for s in seqs)
        return self.kv_cache.num_free_blocks - needed >= self.kv_cache.watermark_blocks

    def _allocate(self, group: SequenceGroup, seqs: list[Sequence]) -> None:
        """Give waiting sequences blocks for all their tokens (prefix-cache hits included).

        The request's `num_cached_tokens` counts the prompt tokens found at its first admission
        only: a re-admission after recomputation finding its own blocks again is no prefix hit.
        """
        first_admission = group.metrics.first_scheduled_time is None
        for seq in seqs:
            cached = self.kv_cache.allocate(seq.seq_id, seq.get_token_ids())
            seq.num_computed_tokens = cached
            if first_admission:
                group.metrics.num_cached_tokens += cached
            seq.status = SequenceStatus.RUNNING

    def _swap_in(self, seqs: list[Sequence], out: SchedulerOutput) -> None:
        """Copy a swapped group's blocks back to the device (the copies go in `out`)."""
        out.swap_in.extend(self.kv_cache.swap_in([s.seq_id for s in seqs]))
        for seq in seqs:
            seq.status = SequenceStatus.RUNNING

    def _append_and_schedule(
        self, group: SequenceGroup, seqs: list[Sequence], out: SchedulerOutput, budget: _Budget
    ) -> None:
        """Give each sequence the slots of its tokens not yet in the cache, then schedule it."""
        for seq in seqs:
            pending = seq.get_token_ids()[self.kv_cache.num_tokens(seq.seq_id) :]
            if pending:
                out.copy.extend(self.kv_cache.append_slots(seq.seq_id, pending))
        self._schedule_tokens(group, seqs, out, budget)

    def _fits_budget(self, seqs: list[Sequence], budget: _Budget) -> bool:
        """Room in this step's budget: one token per sequence with chunked prefill (a chunk
        takes what is left), else every pending token (a prefill is never split)."""
        if self.config.enable_chunked_prefill:
            return budget.fits(seqs, 1)
        pending = sum(max(1, s.get_len() - s.num_computed_tokens) for s in seqs)
        return len(seqs) <= budget.seqs and pending <= budget.tokens

    def _schedule_tokens(
        self, group: SequenceGroup, seqs: list[Sequence], out: SchedulerOutput, budget: _Budget
    ) -> None:
        for seq in seqs:
            remaining = seq.get_len() - seq.num_computed_tokens
            n = min(remaining, budget.tokens) if self.config.enable_chunked_prefill else remaining
            if n <= 0:
                continue
            out.scheduled.append(ScheduledSequence(seq, group, seq.num_computed_tokens, n))
            budget.take(n)
        if group.metrics.first_scheduled_time is None:
            group.metrics.first_scheduled_time = self._now

    def _preempt(
        self, group: SequenceGroup, out: SchedulerOutput, mode: PreemptionMode | None = None
    ) -> None:
        """Take all of a running group's blocks back (all-or-nothing, vLLM paper §4.5).

        `mode` None: the config's mode, else swap groups of several sequences and recompute
        single ones. Swapping falls back to recomputation when the host pool is full. The
        caller takes the group out of `running`; this puts it in `swapped` or `waiting`.
        """
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        mode = (
            mode
            or self.config.preemption_mode
            or (PreemptionMode.SWAP if len(seqs) > 1 else PreemptionMode.RECOMPUTE)
        )
        if not (mode is PreemptionMode.SWAP and self._swap_out(group, seqs, out)):
            self._free_for_recompute(group, seqs)
        group.metrics.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(group)

    def _swap_out(self, group: SequenceGroup, seqs: list[Sequence], out: SchedulerOutput) -> bool:
        """Move a running group's blocks to the host pool; False (nothing done) when it is full."""
        ids = [s.seq_id for s in seqs]
        if not self.kv_cache.can_swap_out(ids):
            return False
        out.swap_out.extend(self.kv_cache.swap_out(ids))
        for seq in seqs:
            seq.status = SequenceStatus.SWAPPED
        self.swapped.append(group)
        return True

    def _free_for_recompute(self, group: SequenceGroup, seqs: list[Sequence]) -> None:
        """Drop a running group's blocks; it prefills prompt + output again when resumed."""
        for seq in seqs:
            self._release(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(group)

    def _release(self, seq: Sequence) -> None:
        if seq.seq_id in self.kv_cache:
            self.kv_cache.free(seq.seq_id)


class FCFSScheduler(Scheduler):
    """First-come-first-served continuous batching with preemption (vLLM)."""

    def schedule(self, now: float) -> SchedulerOutput:
        """Choose this step's work: running groups first, then swapped ones, then new ones.

        `now` is the clock of whoever drives the scheduler: wall time in the engine, simulated
        time in the simulator.
        """
        self._now = now
        out = SchedulerOutput()
        budget = _Budget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_swapped(out, budget)
            if not self.swapped:
                self._schedule_waiting(out, budget)
        return out

    # -- the three queues --------------------------------------------------------------------------

    def _schedule_running(self, out: SchedulerOutput, budget: _Budget) -> None:
        queue = deque(self.running)
        kept: list[SequenceGroup] = []
        while queue:
            group = queue.popleft()
            seqs = group.get_seqs(SequenceStatus.RUNNING)
            if not self._fits_budget(seqs, budget):
                kept.append(group)  # stays running, keeps its blocks, waits for the next step
                continue
            while not self._can_append(seqs):
                victim = queue.pop() if queue else group
                self._preempt(victim, out)
                if victim is group:
                    break
            else:
                self._append_and_schedule(group, seqs, out, budget)
                kept.append(group)
        self.running = kept

    def _schedule_swapped(self, out: SchedulerOutput, budget: _Budget) -> None:
        while self.swapped:
            group = self.swapped[0]
            seqs = group.get_seqs(SequenceStatus.SWAPPED)
            if not self._fits_budget(seqs, budget) or not self._can_swap_in(seqs):
                return
            self.swapped.popleft()
            self._swap_in(seqs, out)
            self._append_and_schedule(group, seqs, out, budget)
            self.running.append(group)

    def _schedule_waiting(self, out: SchedulerOutput, budget: _Budget) -> None:
        while self.waiting:
            group = self.waiting[0]
            seqs = group.get_seqs(SequenceStatus.WAITING)
            if not self._fits_budget(seqs, budget):
                return
            if not self._can_allocate(seqs):
                return  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            self._allocate(group, seqs)
            self._schedule_tokens(group, seqs, out, budget)
            self.running.append(group)
