"""The paper's naive MLFQ (`OneLevelDemotionMLFQ`): demotion one level at a time, checked on
notebook 07's toy by hand, against the scheduler's own naive MLFQ, which demotes to the queue
covering the time a job used."""

from __future__ import annotations

from minipaged.sched.base import SchedulerConfig
from minipaged.sched.cost_model import CostModel
from minipaged.sched.mlfq import MLFQConfig, mlfq_factory
from minipaged.sim.simulator import simulate
from minipaged.sim.traces import TraceRequest
from teaching.baselines import one_level_factory

TOY = CostModel(base=1.0, per_prefill_token=0.25, per_decode_seq=0.0, per_context_token=0.0)
JOBS = [TraceRequest(0.0, 40, 3), TraceRequest(0.0, 4, 6), TraceRequest(0.0, 4, 2),
        TraceRequest(0.0, 4, 2), TraceRequest(3.0, 4, 2)]
CONFIG = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=128, max_model_len=128,
                         enable_chunked_prefill=False)
NAIVE = MLFQConfig(skip_join=False, base_quantum=2.0, quantum_ratio=2.0, num_levels=4,
                   starvation_bound=None)


def run(factory):
    return simulate(JOBS, TOY, factory, num_gpu_blocks=64, block_size=4, config=CONFIG,
                    record_steps=True)


def test_one_level_demotion_by_hand():
    """Job 0's 11-unit prefill overruns Q1..Q3's quanta; one level at a time it drops to Q2 only
    and, first in Q2, decodes before the short jobs that reach Q2 after it."""
    result = run(one_level_factory(NAIVE))
    assert [r.finished_time for r in result.requests] == [21, 29, 26, 27, 28]
    after_prefill = next(s for s in result.steps if s.start == 11.0)
    assert after_prefill.levels["0"] == 1  # Q2


def test_the_schedulers_naive_mlfq_demotes_to_the_covering_queue():
    result = run(mlfq_factory(NAIVE))
    assert [r.finished_time for r in result.requests] == [29, 27, 24, 25, 26]
    assert next(s for s in result.steps if s.start == 11.0).levels["0"] == 3  # Q4


def test_every_demotion_is_one_level_on_a_longer_trace():
    jobs = [TraceRequest(0.1 * i, 4 + (37 * i) % 60, 1 + (13 * i) % 9) for i in range(30)]
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=128,
                             enable_chunked_prefill=False)
    result = simulate(jobs, TOY, one_level_factory(NAIVE), num_gpu_blocks=256, block_size=4,
                      config=config, record_steps=True)
    assert len(result.requests) == len(jobs)
    last: dict[str, int] = {}
    for step in result.steps:
        for job, level in step.levels.items():
            assert level <= last.get(job, 0) + 1, (step.start, job, level)
            last[job] = level
