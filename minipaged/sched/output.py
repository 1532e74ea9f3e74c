"""The data of one scheduling step: its limits, its budget and its plan (vLLM paper §4.5).

`SchedulerConfig` sets a step's limits and the preemption policy; `StepBudget` is what is left
of them while a policy fills the step; `SchedulerOutput` is the plan the engine executes --
which sequences compute which tokens over which block tables (`ScheduledSequence`), and the
block copies that come first. `minipaged.sched.base` makes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from minipaged.sampling.sequence import Sequence, SequenceGroup

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


@dataclass
class ScheduledSequence:
    """One sequence in a step: compute its tokens `[start, start + num_new_tokens)`, reading
    and writing the blocks of `block_table` (as they are once the step's copies are done)."""

    seq: Sequence
    group: SequenceGroup
    start: int
    num_new_tokens: int
    block_table: list[int] = field(default_factory=list)  # set by `Scheduler.schedule`

    @property
    def token_ids(self) -> list[int]:
        return self.seq.get_token_ids()[self.start : self.start + self.num_new_tokens]

    @property
    def needs_logits(self) -> bool:
        """True when this step computes the sequence's last known token: it samples a new one."""
        return self.start + self.num_new_tokens == self.seq.get_len()

    @property
    def is_prefill(self) -> bool:
        """A prompt chunk or a recomputation, as the cost model counts it (not one decode)."""
        return self.num_new_tokens > 1 or self.start < self.seq.get_prompt_len()


@dataclass
class SchedulerOutput:
    """What one step computes and which block movements come first (`minipaged.kv.interface`
    gives their order)."""

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
class StepBudget:
    """What is left of a step's token and sequence budget, and whether a prefill may be cut
    into chunks (with chunked prefill a chunk takes what is left; without, a prefill is never
    split, so all its pending tokens must fit)."""

    tokens: int
    seqs: int
    chunked_prefill: bool = True

    @property
    def exhausted(self) -> bool:
        return self.tokens <= 0 or self.seqs <= 0

    def fits(self, seqs: list[Sequence]) -> bool:
        """Room for these sequences of a group: a token each, or every pending token."""
        if self.chunked_prefill:
            pending = len(seqs)
        else:
            pending = sum(max(1, s.get_len() - s.num_computed_tokens) for s in seqs)
        return len(seqs) <= self.seqs and pending <= self.tokens

    def chunk(self, remaining: int) -> int:
        """How many of a sequence's `remaining` tokens this step computes."""
        return min(remaining, self.tokens) if self.chunked_prefill else remaining

    def take(self, tokens: int, seqs: int = 1) -> None:
        self.tokens -= tokens
        self.seqs -= seqs


class RequestRejectedError(ValueError):
    """A request that can never be served: too long for the model or for the whole KV cache."""
