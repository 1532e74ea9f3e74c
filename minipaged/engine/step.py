"""What the engine and the simulator do alike around one step, and the record of a step.

The engine (`minipaged.engine.engine`) runs a model between `schedule` and `finish_step`; the
simulator (`minipaged.sim.simulator`) advances a clock by a cost model's prediction instead.
Everything else about a step is the same in both, and is written once here:

* `fork_samples`: parallel sampling's fork once the prompt is done (vLLM paper §4.4), through
  the scheduler, which owns the block tables;
* `mark_first_tokens` and `finish_requests`: the request metrics of a step that sampled and of
  the requests it finished;
* `StepRecord` (built by `record_step`): what one step scheduled, moved and preempted, and how
  long it took -- what the engine hands its step observers and the simulator keeps with
  `record_steps=True`; `step_shape` is what the cost model charges for it.

Stop conditions, the third thing both do, are `minipaged.sampling.stopping.finish_if_stopped`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from minipaged.sampling.sequence import Sequence, SequenceGroup
from minipaged.sched.base import ScheduledSequence, Scheduler, SchedulerOutput
from minipaged.sched.cost_model import StepShape

# -- data types -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScheduledWork:
    """One sequence's share of a step: it computed tokens `[start, start + num_new_tokens)`."""

    request_id: str
    seq_id: int
    start: int
    num_new_tokens: int
    is_prefill: bool  # a prompt (or recomputation) chunk; else one decode token
    samples: bool  # the step computed its last known token, so it sampled a new one
    block_table: tuple[int, ...] = ()  # the blocks it read and wrote (the engine records them)


@dataclass(frozen=True)
class StepTimings:
    """Where one engine step's wall time went, in seconds (`time.perf_counter`)."""

    schedule_s: float  # scheduler.schedule
    forward_s: float  # the batch, block movements and forward pass (runner.execute)
    sample_s: float  # sampling, forks, beams, stop checks
    update_s: float  # scheduler.mark_computed and finish_step (KV bookkeeping)
    total_s: float  # the whole step, outputs included


@dataclass(frozen=True)
class StepRecord:
    """One step, as it happened: who ran, which blocks moved, who was preempted, and when.

    `start` / `end` are on the clock of whoever drove the scheduler (the engine's `clock`, the
    simulator's simulated time); `timings` are measured by the engine
    only. `num_running` counts the requests holding device memory during the step; `levels` is
    each request's queue under an MLFQ scheduler (empty otherwise).
    """

    index: int
    start: float
    end: float
    scheduled: tuple[ScheduledWork, ...]
    swap_in: tuple[tuple[int, int], ...] = ()  # (host block, device block)
    swap_out: tuple[tuple[int, int], ...] = ()  # (device block, host block)
    copy: tuple[tuple[int, int], ...] = ()  # copy-on-write (source, destination)
    preempted: tuple[str, ...] = ()  # request ids
    num_swap_blocks_ahead: int = 0  # of the swaps, those made ahead of time (FastServe §4.2)
    num_running: int = 0
    levels: Mapping[str, int] = field(default_factory=dict)
    timings: StepTimings | None = None

    @property
    def request_ids(self) -> tuple[str, ...]:
        """The requests that computed tokens in this step, in batch order."""
        return tuple(dict.fromkeys(work.request_id for work in self.scheduled))

    @property
    def num_batched_tokens(self) -> int:
        return sum(work.num_new_tokens for work in self.scheduled)

    @property
    def shape(self) -> StepShape:
        return step_shape(self.scheduled)


# -- what a step computes ------------------------------------------------------------------------


def step_shape(scheduled: Iterable[ScheduledSequence | ScheduledWork]) -> StepShape:
    """The shape the cost model charges for: prefill tokens, decoding sequences and the context
    those decodes attend to."""
    prefill = decode = context = 0
    for item in scheduled:
        if item.is_prefill:
            prefill += item.num_new_tokens
        else:
            decode += 1
            context += item.start + item.num_new_tokens
    return StepShape(prefill, decode, context)


def record_step(
    index: int,
    start: float,
    end: float,
    out: SchedulerOutput,
    scheduler: Scheduler,
    *,
    block_tables: Iterable[Collection[int]] | None = None,
    num_running: int | None = None,
    timings: StepTimings | None = None,
) -> StepRecord:
    """The record of a step from its scheduler output, taken once its tokens were sampled.

    `block_tables` are the tables of `out.scheduled`, in order (those the forward pass used);
    `num_running` defaults to the scheduler's running requests now.
    """
    tables = block_tables if block_tables is not None else [()] * len(out.scheduled)
    jobs = getattr(scheduler, "jobs", {})  # an MLFQ scheduler's queue state
    return StepRecord(
        index=index,
        start=start,
        end=end,
        scheduled=tuple(
            ScheduledWork(
                s.group.request_id,
                s.seq.seq_id,
                s.start,
                s.num_new_tokens,
                s.is_prefill,
                s.needs_logits,
                tuple(table),
            )
            for s, table in zip(out.scheduled, tables, strict=True)
        ),
        swap_in=tuple(out.swap_in),
        swap_out=tuple(out.swap_out),
        copy=tuple(out.copy),
        preempted=tuple(g.request_id for g in out.preempted),
        num_swap_blocks_ahead=out.num_swap_blocks_ahead,
        num_running=len(scheduler.running) if num_running is None else num_running,
        levels={rid: job.level for rid, job in jobs.items()},
        timings=timings,
    )


# -- forks and request metrics -------------------------------------------------------------------


def fork_samples(
    scheduler: Scheduler, group: SequenceGroup, parent: Sequence, seq_ids: Iterator[int]
) -> list[Sequence]:
    """Parallel sampling (vLLM paper §4.4): once the prompt is done, samples 1..n-1 fork from
    sample 0 and share its blocks. Returns the new samples (none when the group has them all)."""
    children = []
    for index in range(len(group.seqs), group.sampling_params.n):
        child = parent.fork(next(seq_ids), sample_index=index)
        scheduler.fork_sequence(group, parent, child)
        children.append(child)
    return children


def mark_first_tokens(groups: Iterable[SequenceGroup], now: float) -> None:
    """Requests sampling their first token at `now` (time to first token ends here)."""
    for group in groups:
        if group.metrics.first_token_time is None:
            group.metrics.first_token_time = now


def finish_requests(scheduler: Scheduler, now: float) -> list[SequenceGroup]:
    """End the step in the scheduler (the finished sequences' blocks are freed) and stamp the
    requests that finished at `now`."""
    finished = scheduler.finish_step()
    for group in finished:
        group.metrics.finished_time = now
    return finished
