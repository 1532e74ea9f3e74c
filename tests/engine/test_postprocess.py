"""`minipaged.engine.postprocess.OutputProcessor` on its own: one step after the forward pass,
over a real scheduler.

Random batches of requests (greedy, and parallel sampling with `n` up to 3) are prefilled by an
FCFS scheduler; each request's row of logits makes one token overwhelmingly likely, so every
sample must draw it whatever its temperature. After `update`: each request has its `n` samples
(the forks take the next ids of the processor's counter), every sample holds exactly that token
with the log-probability `torch.log_softmax` gives it, the stop checks ran (EOS ends a sample
with "stop", `max_tokens=1` with "length"), time to first token is stamped on the processor's
clock, and what finished was freed and stamped too.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from minipaged.engine.postprocess import OutputProcessor, StepUpdate
from minipaged.kv.manager import KVCacheManager
from minipaged.sampling.params import SamplingParams
from minipaged.sampling.sampler import Sampler
from minipaged.sampling.sequence import SequenceGroup
from minipaged.sched.base import SchedulerConfig
from minipaged.sched.fcfs import FCFSScheduler

VOCAB, EOS, MAX_MODEL_LEN = 16, 0, 64
NOW = 1.5

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
    processor = OutputProcessor(
        scheduler,
        Sampler(torch.Generator().manual_seed(seed)),
        eos_token_ids={EOS},
        max_model_len=MAX_MODEL_LEN,
        clock=lambda: NOW,
    )
    groups = []
    for i, r in enumerate(requests):
        temperature = 1.0 if r["n"] > 1 else 0.0
        params = SamplingParams(n=r["n"], temperature=temperature, max_tokens=r["max_tokens"])
        group = SequenceGroup(
            f"r{i}", [processor.new_sequence(r["prompt"])], params, arrival_time=0.0
        )
        scheduler.add(group)
        groups.append(group)
    out = scheduler.schedule(0.0)
    assert [g for g, _ in scheduler.resolve(out.scheduled)] == groups  # all prefill at once
    rows = torch.randn(len(groups), VOCAB, generator=torch.Generator().manual_seed(seed))
    for row, r in zip(rows, requests, strict=True):
        row[r["target"]] += 40.0  # every other token is ~e^-40 as likely
    update = processor.update(StepUpdate(plan=out), rows)
    assert update.touched == groups and update.failed == []
    finished = [g for g in groups if g.is_finished()]
    assert update.finished == finished and all(g.metrics.finished_time == NOW for g in finished)
    assert all(g.metrics.first_token_time == NOW for g in groups)
    forks = sum(r["n"] - 1 for r in requests)
    # forks took exactly the ids they needed, after the requests' own
    assert next(processor.seq_ids) == len(requests) + forks
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
