"""Beam search over a request's beams (vLLM v0 / Hugging Face), sharing their KV blocks.

One call of `advance_beams` per step and request: the `2 * beam_width` best (beam, token)
continuations are ranked (`minipaged.sampling.beam_scoring`); those ending in a stop token among
the top `beam_width` become finished hypotheses, the best `beam_width` others the new live beams. A
beam chosen several times forks, sharing its blocks, and a beam chosen by nobody is freed (the vLLM
paper, §4.4): both through the scheduler, the only owner of block tables. Only the
`beam_width` best hypotheses are kept, and the search ends by `beam_search_is_done`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

import torch
from torch import Tensor

from minipaged.sampling.beam_scoring import (
    BeamCandidate,
    beam_search_candidates,
    beam_search_is_done,
)
from minipaged.sampling.sequence import Sequence, SequenceGroup, SequenceStatus, StopDecision
from minipaged.sampling.stopping import finish_if_stopped
from minipaged.sched.base import Scheduler


def advance_beams(
    scheduler: Scheduler,
    group: SequenceGroup,
    beams: list[Sequence],
    next_logprobs: Tensor,
    seq_ids: Iterator[int],
    eos_token_ids: Collection[int] = (),
    max_model_len: int | None = None,
) -> None:
    """Extend `group`'s live `beams` by one token, given their `[beams, V]` log-probabilities
    (`Sampler.beam_logprobs`); new sequences take their ids from `seq_ids`."""
    params = group.sampling_params
    width = params.beam_width
    cumulative = torch.tensor([b.cumulative_logprob for b in beams])
    candidates = beam_search_candidates(cumulative, next_logprobs, 2 * width)
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))

    finishing = [c for c in candidates[:width] if c.token_id in stops]
    live = [c for c in candidates if c.token_id not in stops][:width]
    # Free the beams nobody continues first: the group never holds more than `beam_width`
    # live sequences, all a reservation baseline has room for (tests/sched/test_contract.py).
    for index, beam in enumerate(beams):
        if index not in {cand.parent for cand in live}:
            scheduler.free_sequence(group, beam)
    # Fork before any parent changes: a child starts from its parent as it was.
    assigned: list[tuple[Sequence, BeamCandidate]] = []
    used: set[int] = set()
    for cand in live:  # a parent's first candidate continues it, any later one a fork of it
        beam = parent = beams[cand.parent]
        if cand.parent in used:
            beam = parent.fork(next(seq_ids))
            scheduler.fork_sequence(group, parent, beam)
        used.add(cand.parent)
        assigned.append((beam, cand))
    for cand in finishing:
        hypothesis = beams[cand.parent].fork(next(seq_ids))  # no blocks: it is done
        _append_token(hypothesis, cand, next_logprobs, params.logprobs)
        text_without_stop = len(hypothesis.output_text) - hypothesis.new_char_count
        hypothesis.finish(
            StopDecision(SequenceStatus.FINISHED_STOPPED, cand.token_id, text_without_stop)
        )
        group.add(hypothesis)
    for beam, cand in assigned:
        _append_token(beam, cand, next_logprobs, params.logprobs)
        # max_tokens or the context: the beam ends as it is (stop tokens were handled above)
        finish_if_stopped(beam, params, (), max_model_len)
    # Keep the `beam_width` best finished beams.
    hypotheses = group.by_beam_score([s for s in group.seqs if s.is_finished()], eos_token_ids)
    for seq in hypotheses[width:]:
        scheduler.free_sequence(group, seq)
    if _is_done(group, eos_token_ids):
        for beam in group.get_unfinished_seqs():
            scheduler.free_sequence(group, beam)


def _append_token(seq: Sequence, cand: BeamCandidate, next_logprobs: Tensor, k: int | None) -> None:
    """Append `cand`'s token to `seq` with vLLM's per-token logprobs: the `k` most likely tokens
    after its parent, plus the chosen one (none when the request did not ask for them)."""
    alternatives: dict[int, float] | None = None
    if k is not None:
        alternatives = {}
        if k > 0:
            top = torch.topk(next_logprobs[cand.parent], k)
            alternatives.update(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        alternatives[cand.token_id] = float(cand.logprob)
    seq.append_token(cand.token_id, cand.logprob, alternatives)


def _is_done(group: SequenceGroup, eos_token_ids: Collection[int]) -> bool:
    params = group.sampling_params
    live = group.get_unfinished_seqs()
    if not live:
        return True
    done = [s for s in group.seqs if s.is_finished()]
    scores = [s.beam_search_score(params.length_penalty, eos_token_ids) for s in done]
    best = max(live, key=lambda s: s.cumulative_logprob)
    return beam_search_is_done(
        best_running_cumulative_logprob=best.cumulative_logprob,
        best_running_len=best.get_len(),
        worst_finished_score=min(scores) if scores else None,
        num_finished=len(done),
        beam_width=params.beam_width,
        length_penalty=params.length_penalty,
    )
