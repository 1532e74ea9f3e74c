"""The data of one scheduling step: its limits, its budget and its plan (vLLM paper §4.5).

`SchedulerConfig` sets a step's limits and the preemption mode every scheduler reads;
`StepBudget` is what is left of them while a policy fills the step; `SchedulerOutput` is the
plan the model runner executes -- which sequences compute which tokens over which block tables
(`ScheduledSequence`), and the block movements that come first -- and the step record keeps.
`minipaged.sched.base` makes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

# -- data types -----------------------------------------------------------------------------------


class PreemptionMode(str, Enum):
    """How a preempted group gives back its GPU blocks (vLLM paper §4.5; FastServe §4.2 and
    its recomputation ablation): the one choice of every scheduler, `SchedulerConfig`'s."""

    RECOMPUTE = "recompute"  # free the blocks; later prefill prompt + generated tokens again
    SWAP = "swap"  # copy the blocks to the CPU pool; later copy them back


@dataclass
class SchedulerConfig:
    """The limits of one step, and the preemption mode."""

    max_num_batched_tokens: int = 2048  # tokens computed in one step (prefill chunks + decodes)
    max_num_seqs: int = 64  # sequences in one step
    max_model_len: int = 2048  # context length: prompt + output
    enable_chunked_prefill: bool = True
    # None: the policy's default (`Scheduler.default_preemption_mode`): vLLM's rule for FCFS
    # and the baselines (recompute a single sequence, swap a group of several: parallel
    # samples, beams), swapping for skip-join MLFQ. Swapping falls back to recomputation when
    # the CPU pool is full.
    preemption_mode: PreemptionMode | None = None
    # vLLM's: with chunked prefill, no sequence computes more than this many tokens in one step,
    # so a long prompt leaves the rest of each step's budget to others (0: no limit).
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0 (0: no limit), "
                f"got {self.long_prefill_token_threshold}"
            )
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError(
                "long_prefill_token_threshold cuts prefills into chunks: it needs "
                "enable_chunked_prefill"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
        if self.preemption_mode is not None:
            self.preemption_mode = PreemptionMode(self.preemption_mode)


class ScheduledSequence(NamedTuple):
    """One sequence's share of a step, the one type from the scheduler to the model runner to
    the step record: compute `token_ids` at positions `start, start + 1, ...`, reading and
    writing the blocks of `block_table` (as they are once the step's copies are done).

    Plain data, taken when the step is planned, so a record of the step stays true after the
    sequence grows, and the plan crosses process boundaries (tensor parallelism) as it is. The
    scheduler resolves the ids to its objects (`Scheduler.resolve`). `block_table` is the KV
    manager's own immutable tuple, the same object from step to step until a block is added
    or moved: the runner rewrites a row of its persistent block tables only when it changes.
    """

    request_id: str
    seq_id: int
    start: int
    token_ids: tuple[int, ...]
    # The step computes the sequence's last known token, so it samples a new one.
    needs_logits: bool = True
    # A prompt chunk or a recomputation, as the cost model counts it (not one decode).
    is_prefill: bool = False
    block_table: tuple[int, ...] = ()

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """One step's plan: what it computes, and the block movements that come first
    (`minipaged.kv.interface` gives their order). The model runner executes it as it is.

    It is the step's batch as the scheduler's layer can say it: ids, token ids and block ids,
    no tensors (the scheduler sits below the runner, and the simulator runs it with none), so
    it is also what the step record keeps and what crosses to tensor-parallel ranks. The
    runner turns it into the forward pass's tensors itself.
    """

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (CPU block, GPU block)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (GPU block, CPU block)
    copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (source, dest)
    preempted: list[str] = field(default_factory=list)  # request ids

    # Blocks of `swap_in` / `swap_out` moved ahead of time for groups not in this step's batch
    # (proactive swapping, FastServe §4.2): a server overlaps them with the forward pass.
    num_swap_blocks_ahead: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def moves_blocks(self) -> bool:
        return bool(self.swap_in or self.swap_out or self.copy)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.moves_blocks)


@dataclass
class StepBudget:
    """What is left of a step's token and sequence budget, and whether a prefill may be cut
    into chunks (`Scheduler.step_plan` cuts them)."""

    tokens: int
    seqs: int
    chunked_prefill: bool = True

    @property
    def exhausted(self) -> bool:
        return self.tokens <= 0 or self.seqs <= 0

    def take(self, tokens: int, seqs: int = 1) -> None:
        self.tokens -= tokens
        self.seqs -= seqs


class RequestRejectedError(ValueError):
    """A request that can never be served: too long for the model or for the whole KV cache."""
