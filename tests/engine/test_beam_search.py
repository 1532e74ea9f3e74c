"""`minipaged.engine.beam_search.advance_beams` on its own, against a brute-force ranking.

A request's beams are prefilled by a real FCFS scheduler; random log-probabilities are handed
to `advance_beams` step after step. Each step the live beams must be the `beam_width` best
(beam, token) continuations that do not end in a stop token, found by scoring every pair; a
stop token among the `beam_width` best becomes a finished hypothesis; forks share their
parent's blocks and unchosen beams give theirs back (the vLLM paper, §4.4): when the request
ends, every block is free again.
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.engine.beam_search import advance_beams
from minipaged.kv.manager import KVCacheManager
from minipaged.sampling.params import SamplingParams
from minipaged.sampling.sequence import Sequence, SequenceGroup
from minipaged.sched.base import SchedulerConfig
from minipaged.sched.fcfs import FCFSScheduler

VOCAB, EOS, NUM_BLOCKS = 8, 0, 64


def brute_force(beams: list[Sequence], logprobs: torch.Tensor, width: int):
    """Every (beam, token) pair scored, best first (ties by beam, then token)."""
    pairs = [
        (beams[b].cumulative_logprob + float(logprobs[b, t]), b, t)
        for b in range(len(beams)) for t in range(VOCAB)
    ]
    pairs.sort(key=lambda p: (-p[0], p[1], p[2]))
    top = pairs[: 2 * width]
    finished = [p for p in top[:width] if p[2] == EOS]
    live = [p for p in top if p[2] != EOS][:width]
    return live, finished


@settings(max_examples=40, deadline=None)
@given(width=st.integers(1, 4), steps=st.integers(1, 5), seed=st.integers(0, 2**16),
       prompt=st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=9))
def test_each_step_keeps_the_best_continuations_and_frees_the_rest(width, steps, seed, prompt):
    kv = KVCacheManager(NUM_BLOCKS, 4)
    scheduler = FCFSScheduler(SchedulerConfig(max_model_len=64), kv)
    params = SamplingParams(use_beam_search=True, beam_width=width, n=1, temperature=0.0,
                            max_tokens=steps)
    group = SequenceGroup("r", [Sequence(0, prompt)], params, arrival_time=0.0)
    scheduler.add(group)
    gen = torch.Generator().manual_seed(seed)
    ids = itertools.count(1)
    hypotheses: set = set()  # (tokens, cumulative logprob) of every hypothesis made
    for _ in range(steps):
        out = scheduler.schedule(0.0)
        scheduler.mark_computed(out)
        beams = [seq for _, seq in scheduler.resolve(out.scheduled)]
        logprobs = torch.log_softmax(torch.randn(len(beams), VOCAB, generator=gen), dim=-1)
        live, finished = brute_force(beams, logprobs, width)
        expected_live = sorted(
            (beams[b].output_token_ids + [t], round(score, 4)) for score, b, t in live
        )
        hypotheses |= {
            (tuple(beams[b].output_token_ids + [t]), round(score, 4)) for score, b, t in finished
        }
        advance_beams(scheduler, group, beams, logprobs, ids, eos_token_ids={EOS},
                      max_model_len=64)
        if group.get_unfinished_seqs():  # at the end live beams join the hypotheses instead
            got_live = sorted(
                (s.output_token_ids, round(s.cumulative_logprob, 4))
                for s in group.get_unfinished_seqs()
            )
            assert got_live == expected_live
        else:  # beams that reached max_tokens are finished hypotheses too
            hypotheses |= {(tuple(tokens), score) for tokens, score in expected_live}
        kept = {
            (tuple(s.output_token_ids), round(s.cumulative_logprob, 4))
            for s in group.seqs if s.is_finished()
        }
        assert kept <= hypotheses and len(kept) <= width  # only the best width are kept
        assert group.request_id in [g.request_id for g in scheduler.finish_step()] or (
            group.get_unfinished_seqs()
        )
        if not group.get_unfinished_seqs():
            break
    assert not scheduler.has_unfinished()
    assert kv.num_free_blocks == NUM_BLOCKS  # every fork's and freed beam's blocks came back
