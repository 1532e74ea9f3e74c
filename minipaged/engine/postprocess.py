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
logits' rows; grouped by request they become `RequestSamples`, with a finished prompt's forks
sharing its row.
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


class RequestSamples(NamedTuple):
    """One request's sequences that sample this step, and the row of the logits each reads: a
    request is sampled (and, on failure, retried) as a whole, and a finished prompt's forked
    samples share its row."""

    group: SequenceGroup
    seqs: list[Sequence]
    rows: list[int]



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
        self.scheduler.mark_computed(update.plan)
        members = self.scheduler.resolve(s for s in update.plan.scheduled if s.needs_logits)
        now = self.clock()
        touched = list({id(group): group for group, _ in members}.values())
        for group in touched:
            if group.metrics.first_token_time is None:  # time to first token ends here
                group.metrics.first_token_time = now
        self.sample_isolated(members, logits, update)
        failed = set(update.failed)
        update.touched = [g for g in touched if g.request_id not in failed]
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
        the `i`-th's); when that fails, each request again on its own, and only those that fail
        alone end with "error" (a request's own parameters never end another's). Forks come
        first, outside the retries: they are bookkeeping that bad parameters cannot break, and
        a retry must not fork twice."""
        requests = self.requests_of(members)
        beams = [r for r in requests if r.group.sampling_params.use_beam_search]
        plain = [r for r in requests if not r.group.sampling_params.use_beam_search]
        # each request's beams advance on their own
        failed = [r.group.request_id for r in beams if not self.try_sample([r], logits)]
        if plain and not self.try_sample(plain, logits):
            logger.warning("sampling the step failed; sampling its requests one at a time")
            failed += [r.group.request_id for r in plain if not self.try_sample([r], logits)]
        self.fail(failed, update)

    def requests_of(self, members: list[GroupMember]) -> list[RequestSamples]:
        """The step's sampling sequences (row `i` of the logits the `i`-th's) by request; a
        request whose prompt just finished gets its forked samples here, sharing the prompt's
        row."""
        requests: dict[str, RequestSamples] = {}
        for row, (group, seq) in enumerate(members):
            request = requests.setdefault(group.request_id, RequestSamples(group, [], []))
            request.seqs.append(seq)
            request.rows.append(row)
        for group, seqs, rows in requests.values():
            if not group.sampling_params.use_beam_search:
                forks = self.fork_samples(group, seqs[0])
                seqs += forks
                rows += [rows[0]] * len(forks)
        return list(requests.values())

    def try_sample(self, requests: list[RequestSamples], logits: Tensor) -> bool:
        try:
            self.sample(requests, logits)
        except Exception:
            names = ", ".join(r.group.request_id for r in requests)
            logger.exception("sampling failed for request(s) %s", names)
            return False
        return True

    def sample(self, requests: list[RequestSamples], logits: Tensor) -> None:
        """The next token of every sequence of `requests` (their rows of `logits`): plain and
        parallel samples through the sampler at once, a beam-search request through its beams;
        then the stop rules."""
        plain: list[GroupMember] = []
        plain_rows: list[int] = []
        for group, seqs, rows in requests:
            if group.sampling_params.use_beam_search:
                beam_rows = [group.sampling_row(b, self.eos_token_ids) for b in seqs]
                next_logprobs = self.sampler.beam_logprobs(logits[rows], beam_rows)
                advance_beams(
                    self.scheduler, group, seqs, next_logprobs, self.seq_ids,
                    self.eos_token_ids, self.max_model_len,
                )
                continue
            plain += [GroupMember(group, seq) for seq in seqs]
            plain_rows += rows
        if not plain:
            return
        sampling_rows = [group.sampling_row(seq, self.eos_token_ids) for group, seq in plain]
        in_order = plain_rows == list(range(logits.shape[0]))  # a decode step's: no copy
        result = self.sampler(logits if in_order else logits[plain_rows], sampling_rows)
        tokens, logprobs = result.token_ids.tolist(), result.logprobs.tolist()
        for i, (group, seq) in enumerate(plain):
            seq.append_token(tokens[i], logprobs[i], result.logprobs_dict(i))
            self.check_stop(seq, group)

    def fork_samples(self, group: SequenceGroup, parent: Sequence) -> list[Sequence]:
        """Parallel sampling (vLLM paper §4.4): once the prompt is done, samples 1..n-1 fork
        from sample 0 and share its blocks, through the scheduler, which owns the block tables.
        Returns the new samples (none when the group has them all)."""
        children = []
        for index in range(len(group.seqs), group.sampling_params.n):
            child = parent.fork(next(self.seq_ids), sample_index=index)
            self.scheduler.fork_sequence(group, parent, child)
            children.append(child)
        return children

    def check_stop(self, seq: Sequence, group: SequenceGroup) -> None:
        finish_if_stopped(seq, group.sampling_params, self.eos_token_ids, self.max_model_len)
