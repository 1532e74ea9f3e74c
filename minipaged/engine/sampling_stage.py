"""The sampling stage of an engine step: the logits of every sampling sequence become tokens.

A request's first token ends its prompt: parallel sampling forks the `n - 1` other samples then
(vLLM paper §4.4), each drawing its own first token from the prompt's row of logits with its own
generator. Plain and parallel samples of the whole batch go through the `Sampler` at once; beam
search requests advance their beams (`minipaged.engine.beam_search`). Every new token then goes
through the stop checks.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

from torch import Tensor

from minipaged.engine.beam_search import advance_beams
from minipaged.engine.step import fork_samples, mark_first_tokens
from minipaged.sampling.sampler import Sampler
from minipaged.sampling.sequence import Sequence, SequenceGroup
from minipaged.sampling.stopping import finish_if_stopped
from minipaged.sched.base import ScheduledSequence, Scheduler


def sample_tokens(
    items: list[ScheduledSequence],
    logits: Tensor,
    *,
    sampler: Sampler,
    scheduler: Scheduler,
    seq_ids: Iterator[int],
    eos_token_ids: Collection[int],
    max_model_len: int,
    now: float,
) -> list[SequenceGroup]:
    """Sample the next token of every item (`logits` has one row per item, in order); return
    the requests that got tokens, stamping first tokens with `now`. Forked samples and beams
    take their ids from `seq_ids`."""
    rows_of: dict[str, list[int]] = {}
    groups: dict[str, SequenceGroup] = {}
    for row, item in enumerate(items):
        rows_of.setdefault(item.group.request_id, []).append(row)
        groups[item.group.request_id] = item.group
    mark_first_tokens(groups.values(), now)
    plain_seqs: list[Sequence] = []
    plain_rows: list[int] = []
    for request_id, group in groups.items():
        rows = rows_of[request_id]
        seqs = [items[r].seq for r in rows]
        if group.sampling_params.use_beam_search:
            beam_rows = [group.sampling_row(b, eos_token_ids) for b in seqs]
            next_logprobs = sampler.beam_logprobs(logits[rows], beam_rows)
            advance_beams(
                scheduler, group, seqs, next_logprobs, seq_ids, eos_token_ids, max_model_len
            )
            continue
        forks = fork_samples(scheduler, group, seqs[0], seq_ids)
        plain_seqs += seqs + forks
        plain_rows += rows + [rows[0]] * len(forks)
    if plain_seqs:
        owner = {seq.seq_id: group for group in groups.values() for seq in group.seqs}
        sampling_rows = [owner[s.seq_id].sampling_row(s, eos_token_ids) for s in plain_seqs]
        result = sampler(logits[plain_rows], sampling_rows)
        tokens, logprobs = result.token_ids.tolist(), result.logprobs.tolist()
        for i, seq in enumerate(plain_seqs):
            seq.append_token(tokens[i], logprobs[i], result.logprobs_dict(i))
            params = owner[seq.seq_id].sampling_params
            finish_if_stopped(seq, params, eos_token_ids, max_model_len)
    return list(groups.values())
