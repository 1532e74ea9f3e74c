"""`minipaged.engine.sampling_stage` on its own: one step's sampling over a real scheduler.

Random batches of requests (greedy, and parallel sampling with `n` up to 3) are prefilled by an
FCFS scheduler; each request's row of logits makes one token overwhelmingly likely, so every
sample must draw it whatever its temperature. After `sample_tokens`: each request has its `n`
samples (the forks take fresh ids from the iterator given), every sample holds exactly that
token with the log-probability `torch.log_softmax` gives it, the stop checks ran (EOS ends a
sample with "stop", `max_tokens=1` with "length"), and time to first token is stamped.
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import given
from hypothesis import strategies as st

from minipaged.engine.sampling_stage import sample_tokens
from minipaged.kv.manager import KVCacheManager
from minipaged.sampling.params import SamplingParams
from minipaged.sampling.sampler import Sampler
from minipaged.sampling.sequence import Sequence, SequenceGroup
from minipaged.sched.base import SchedulerConfig
from minipaged.sched.fcfs import FCFSScheduler

VOCAB, EOS, MAX_MODEL_LEN, FIRST_FORK_ID = 16, 0, 64, 1000

request = st.fixed_dictionaries(
    {
        "prompt": st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=6),
        "n": st.integers(1, 3),
        "max_tokens": st.integers(1, 3),
        "target": st.integers(0, VOCAB - 1),
    }
)


@given(requests=st.lists(request, min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_one_step_gives_every_sample_its_token_and_runs_the_stop_checks(requests, seed) -> None:
    scheduler = FCFSScheduler(SchedulerConfig(max_model_len=MAX_MODEL_LEN), KVCacheManager(64, 4))
    groups = []
    for i, r in enumerate(requests):
        temperature = 1.0 if r["n"] > 1 else 0.0
        params = SamplingParams(n=r["n"], temperature=temperature, max_tokens=r["max_tokens"])
        group = SequenceGroup(f"r{i}", [Sequence(i, r["prompt"])], params, arrival_time=0.0)
        scheduler.add(group)
        groups.append(group)
    out = scheduler.schedule(0.0)
    assert [item.group for item in out.scheduled] == groups  # the whole batch prefills at once
    scheduler.mark_computed(out)
    rows = torch.randn(len(groups), VOCAB, generator=torch.Generator().manual_seed(seed))
    for row, r in zip(rows, requests, strict=True):
        row[r["target"]] += 40.0  # every other token is ~e^-40 as likely
    ids = itertools.count(FIRST_FORK_ID)
    sampled = sample_tokens(
        out.scheduled,
        rows,
        sampler=Sampler(torch.Generator().manual_seed(seed)),
        scheduler=scheduler,
        seq_ids=ids,
        eos_token_ids={EOS},
        max_model_len=MAX_MODEL_LEN,
        now=1.5,
    )
    assert sampled == groups
    assert all(g.metrics.first_token_time == 1.5 for g in groups)
    forks = sum(r["n"] - 1 for r in requests)
    assert next(ids) == FIRST_FORK_ID + forks  # forks took exactly the ids they needed
    seq_ids = [s.seq_id for g in groups for s in g.seqs]
    assert len(set(seq_ids)) == len(seq_ids)
    for group, row, r in zip(groups, rows, requests, strict=True):
        assert len(group.seqs) == r["n"]
        assert group.metrics.first_token_time is not None
        expected_logprob = torch.log_softmax(row, dim=-1)[r["target"]].item()
        for seq in group.seqs:
            assert seq.prompt_token_ids == r["prompt"]
            assert seq.output_token_ids == [r["target"]]
            assert abs(seq.cumulative_logprob - expected_logprob) < 1e-4
            if r["target"] == EOS:
                assert seq.status.finish_reason == "stop"
            elif r["max_tokens"] == 1:
                assert seq.status.finish_reason == "length"
            else:
                assert not seq.is_finished()
