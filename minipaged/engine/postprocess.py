"""Everything after the forward pass, owned by one object: `OutputProcessor`.

Per step (docs/architecture.md, "One step of the engine"): record the computed tokens in the
scheduler, turn each sampling sequence's logits into its next token, fork a finished prompt's
parallel samples (vLLM paper §4.4), advance beam search (`minipaged.engine.beam_search`), check
the stop rules, free what finished, and stamp the request metrics on the engine's clock. The
processor owns what those need and nothing else reads: the sampler, the EOS ids,
`max_model_len`, the counter of sequence ids and the clock.

A request's own parameters can never end another request: when sampling fails, each request
of the step is sampled again on its own, and only those that fail alone end with finish reason
"error" (`StepUpdate.failed`). The simulator's processor (`minipaged.sim.simulator`) replaces
`sample` with made-up tokens and keeps the rest.

The step's sampling sequences come from the scheduler as `GroupMember`s, in the order of the
logits' rows; with a finished prompt's forks, which share its row, they become `Sample`s.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from torch import Tensor

from minipaged.engine.beam_search import advance_beams
from minipaged.sampling.sampler import Sampler
from minipaged.sampling.sequence import (
    GroupMember,
    IncrementalDetokenizer,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)
from minipaged.sampling.stopping import finish_if_stopped
from minipaged.sched.base import Scheduler
from minipaged.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)

# -- data types -----------------------------------------------------------------------------------


class Sample(NamedTuple):
    """One sequence that samples this step, its request, and the row of the logits it reads
    (a finished prompt's forked samples share its row)."""

    group: SequenceGroup
    seq: Sequence
    row: int


@dataclass
class StepUpdate:
    """What a step changed: the plan it computed, the requests that got tokens, those that
    finished (with tokens or with an error), and the ids of those that failed."""

    plan: SchedulerOutput
    touched: list[SequenceGroup] = field(default_factory=list)
    finished: list[SequenceGroup] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


# -- the processor --------------------------------------------------------------------------------


class OutputProcessor:
    """Turns a computed step into tokens, forks, stops, freed blocks and request metrics."""

    def __init__(
        self,
        scheduler: Scheduler,
        sampler: Sampler,
        *,
        eos_token_ids: Collection[int],
        max_model_len: int,
        clock: Callable[[], float],
    ) -> None:
        self.scheduler = scheduler
        self.sampler = sampler
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.clock = clock
        self.seq_ids = itertools.count()

    def new_sequence(
        self, token_ids: list[int], detokenizer: IncrementalDetokenizer | None = None
    ) -> Sequence:
        """A request's first sequence, with the next free sequence id."""
        return Sequence(next(self.seq_ids), token_ids, detokenizer)

    # -- ending requests --------------------------------------------------------------------------

    def abort(
        self, request_id: str, status: SequenceStatus = SequenceStatus.FINISHED_ABORTED
    ) -> SequenceGroup | None:
        """End a request wherever it is (its blocks come back), stamping its finish."""
        group = self.scheduler.abort(request_id, status)
        if group is not None:
            group.metrics.finished_time = self.clock()
        return group

    def fail(self, request_ids: Iterable[str], update: StepUpdate) -> None:
        """End each request with finish reason "error" and note it in `update`."""
        for request_id in dict.fromkeys(request_ids):
            group = self.abort(request_id, SequenceStatus.FINISHED_ERROR)
            if group is not None:
                update.finished.append(group)
                update.failed.append(request_id)

    # -- one step ---------------------------------------------------------------------------------

    def update(self, update: StepUpdate, logits: Tensor) -> StepUpdate:
        """Everything after the forward pass of `update.plan`, whose sampling sequences' rows
        are `logits` (in plan order); `update` may already hold requests the forward pass
        failed."""
        members = self.scheduler.mark_computed(update.plan)
        now = self.clock()
        touched = list(dict.fromkeys([member.group for member in members]))
        for group in touched:
            if group.metrics.first_token_time is None:  # time to first token ends here
                group.metrics.first_token_time = now
        self.sample_isolated(members, logits, update)
        failed = update.failed
        update.touched = [g for g in touched if g.request_id not in failed] if failed else touched
        finished = self.scheduler.finish_step()
        end = self.clock()
        for group in finished:
            group.metrics.finished_time = end
        update.finished += finished
        return update

    def sample_isolated(
        self, members: list[GroupMember], logits: Tensor, update: StepUpdate
    ) -> None:
        """`sample` the step's requests (`members`: the sampling sequences, row `i` of `logits`
        the `i`-th's): each beam-search request on its own, the others at once; when that
        fails, each of them again on its own, and only those that fail alone end with "error"
        (a request's own parameters never end another's). Forks come first, outside the
        retries: they are bookkeeping that bad parameters cannot break, and a retry must not
        fork twice."""
        samples = self.samples_of(members)
        plain = [s for s in samples if not s.group.sampling_params.use_beam_search]
        if plain and self.try_sample(plain, logits):  # what is left: beam search
            samples = [s for s in samples if s.group.sampling_params.use_beam_search]
        elif plain:
            logger.warning("sampling the step failed; sampling its requests one at a time")
        alone: dict[str, list[Sample]] = {}  # each request on its own
        for sample in samples:
            alone.setdefault(sample.group.request_id, []).append(sample)
        self.fail([r for r, own in alone.items() if not self.try_sample(own, logits)], update)

    def samples_of(self, members: list[GroupMember]) -> list[Sample]:
        """The step's sampling sequences with the row of the logits each reads (row `i` the
        `i`-th member's); a request whose prompt just finished gets its forked samples here,
        sharing the prompt's row."""
        samples = []
        for row, (group, seq) in enumerate(members):
            samples.append(Sample(group, seq, row))
            params = group.sampling_params
            if len(group.seqs) >= params.n or params.use_beam_search:  # all there
                continue
            # Parallel sampling (vLLM paper §4.4): once the prompt is done, samples 1..n-1 fork
            # from sample 0 and share its blocks, through the scheduler (the block tables').
            for index in range(len(group.seqs), params.n):
                child = seq.fork(next(self.seq_ids), sample_index=index)
                self.scheduler.fork_sequence(group, seq, child)
                samples.append(Sample(group, child, row))
        return samples

    def try_sample(self, samples: list[Sample], logits: Tensor) -> bool:
        try:
            self.sample(samples, logits)
        except Exception:
            names = ", ".join(dict.fromkeys(s.group.request_id for s in samples))
            logger.exception("sampling failed for request(s) %s", names)
            return False
        return True

    def sample(self, samples: list[Sample], logits: Tensor) -> None:
        """The next token of every sample (of one beam-search request, its beams; else of any
        requests at once, through the sampler, in one device-to-host copy); then the stop
        rules."""
        rows = [sample.row for sample in samples]
        device, eos = logits.device, self.eos_token_ids
        sampling_rows = [group.sampling_row(seq, eos, device) for group, seq, _ in samples]
        group = samples[0].group
        if group.sampling_params.use_beam_search:
            next_logprobs = self.sampler.beam_logprobs(logits[rows], sampling_rows)
            advance_beams(self.scheduler, group, [s.seq for s in samples], next_logprobs,
                          self.seq_ids, eos, self.max_model_len)
            return
        in_order = rows == list(range(logits.shape[0]))  # a decode step's: no copy
        result = self.sampler(logits if in_order else logits[rows], sampling_rows)
        for (group, seq, _), sampled in zip(samples, result.to_host(), strict=True):
            seq.append_token(*sampled)
            finish_if_stopped(seq, group.sampling_params, eos, self.max_model_len)
