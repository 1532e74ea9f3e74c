"""The simulator: exact times on hand-built traces, every request served on random ones, arrival
processes with the asked-for statistics, and agreement with the real engine on this machine."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_llama_parts

from minipaged.engine.engine import EngineConfig, LLMEngine
from minipaged.kv.manager import KVCacheManager
from minipaged.sampling.params import SamplingParams
from minipaged.sampling.sequence import Sequence, SequenceGroup
from minipaged.sched.base import SchedulerConfig
from minipaged.sched.cost_model import CostModel, StepShape
from minipaged.sched.fcfs import FCFSScheduler
from minipaged.sched.mlfq import MLFQ_VARIANTS, MLFQConfig, mlfq_factory
from minipaged.sim.profiling import replay_on_engine
from minipaged.sim.simulator import simulate, step_duration
from minipaged.sim.traces import (
    TraceRequest,
    gamma_arrival_times,
    heavy_tailed,
    poisson_arrival_times,
    with_arrivals,
)

# One second per step whatever it holds: times count steps.
UNIT = CostModel(base=1.0, per_prefill_token=0.0, per_decode_seq=0.0, per_context_token=0.0)


def config(**kwargs) -> SchedulerConfig:
    kwargs.setdefault("max_model_len", 256)
    return SchedulerConfig(**kwargs)


def test_one_request_takes_one_step_per_output_token():
    result = simulate([TraceRequest(0.0, 10, 5)], UNIT, num_gpu_blocks=16, block_size=4)
    (r,) = result.requests
    assert r.ttft == 1.0  # the prefill step samples the first token
    assert r.jct == 5.0 and r.normalized_latency == 1.0
    assert result.num_steps == 5 and result.throughput == pytest.approx(1 / 5)


def test_fcfs_head_of_line_blocking_and_mlfq_relief():
    # One sequence per step. A long job arrives first, three short ones just after.
    trace = [TraceRequest(0.0, 4, 20)] + [TraceRequest(0.5, 4, 2) for _ in range(3)]
    fcfs = simulate(trace, UNIT, num_gpu_blocks=64, block_size=4, config=config(max_num_seqs=1))
    # Run to completion: the long job ends at 20, the short ones at 22, 24, 26.
    assert [r.finished_time for r in fcfs.requests] == [20.0, 22.0, 24.0, 26.0]
    mlfq = MLFQConfig(base_quantum=1.0, starvation_bound=None)
    fast = simulate(
        trace, UNIT, mlfq_factory(mlfq), num_gpu_blocks=64, block_size=4,
        config=config(max_num_seqs=1)
    )
    # The long job is demoted after its first quantum; the short ones overtake it.
    assert max(r.finished_time for r in fast.requests[1:]) < fast.requests[0].finished_time
    assert fast.mean_jct < fcfs.mean_jct
    assert fast.makespan == fcfs.makespan  # the same work, in another order


def test_swaps_made_ahead_of_time_overlap_with_compute():
    cost = CostModel(1.0, 0.0, 0.0, 0.0, per_swap_block=0.25)
    shape = StepShape(decode_seqs=1, context_tokens=4)
    assert step_duration(cost, shape, swapped=2, ahead=0) == 1.5
    assert step_duration(cost, shape, swapped=2, ahead=2) == 1.0
    assert step_duration(cost, shape, swapped=8, ahead=8) == 2.0
    assert step_duration(cost, shape, swapped=6, ahead=4) == 1.5


@given(
    lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30)), min_size=1, max_size=12),
    rate=st.floats(0.5, 20.0),
    scheduler=st.sampled_from(["fcfs", *sorted(MLFQ_VARIANTS)]),
    seed=st.integers(0, 100),
)
@settings(max_examples=30)
def test_every_request_is_served_with_its_output_length(lengths, rate, scheduler, seed):
    cost = CostModel(0.01, 1e-4, 1e-3, 1e-6, per_swap_block=1e-3)
    arrivals = poisson_arrival_times(len(lengths), rate, np.random.default_rng(seed))
    trace = [TraceRequest(float(t), p, o) for t, (p, o) in zip(arrivals, lengths, strict=True)]
    factory = FCFSScheduler if scheduler == "fcfs" else MLFQ_VARIANTS[scheduler].factory()
    result = simulate(
        trace,
        cost,
        factory,
        num_gpu_blocks=20,
        block_size=4,
        num_cpu_blocks=40,
        config=config(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=80),
    )
    assert [r.output_len for r in result.requests] == [o for _, o in lengths]
    for r, request in zip(result.requests, trace, strict=True):
        assert r.arrival_time == request.arrival_time
        assert request.arrival_time < r.first_token_time <= r.finished_time
    total = sum(step.end - step.start for step in result.steps)
    assert total <= result.makespan + 1e-9


def test_record_steps_and_levels():
    trace = [TraceRequest(0.0, 4, 6), TraceRequest(0.0, 30, 3)]
    cost = CostModel(0.01, 0.001, 0.0, 0.0)
    mlfq = MLFQConfig(base_quantum=0.02)
    result = simulate(
        trace, cost, mlfq_factory(mlfq), num_gpu_blocks=32, block_size=4, record_steps=True
    )
    assert len(result.steps) == result.num_steps
    first = result.steps[0]
    # Skip-join: the short prompt (14 ms) enters Q1, the long one (40 ms) Q2 (40 ms quantum).
    assert first.levels == {"0": 0, "1": 1}
    assert all(a.end == b.start for a, b in zip(result.steps, result.steps[1:], strict=False))


# -- ready groups, a given KV cache, a sampling hook -------------------------------------------


def group(rid: int, prompt: list[int], max_tokens: int, arrival: float, n: int = 1):
    temperature = 1.0 if n > 1 else 0.0  # parallel samples need sampling, not greedy
    params = SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    return SequenceGroup(str(rid), [Sequence(rid, prompt)], params, arrival_time=arrival)


@given(
    lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30)), min_size=1, max_size=8),
    seed=st.integers(0, 100),
)
@settings(max_examples=15)
def test_groups_serve_like_the_trace_of_their_lengths(lengths, seed):
    # Without prefix caching the prompt tokens cannot matter: only the lengths and arrivals do.
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrival_times(len(lengths), 5.0, rng)
    trace = [TraceRequest(float(t), p, o) for t, (p, o) in zip(arrivals, lengths, strict=True)]
    groups = [
        group(i, rng.integers(3, 1000, r.prompt_len).tolist(), r.output_len, r.arrival_time)
        for i, r in enumerate(trace)
    ]
    kwargs = dict(num_gpu_blocks=20, block_size=4, config=config(max_num_seqs=4, max_model_len=80))
    cost = CostModel(0.01, 1e-4, 1e-3, 1e-6)
    from_trace = simulate(trace, cost, **kwargs)
    from_groups = simulate(None, cost, groups=groups, **kwargs)
    assert from_groups.requests == from_trace.requests
    assert from_groups.num_steps == from_trace.num_steps


def test_a_given_kv_cache_with_prefix_caching_skips_the_shared_prefix():
    # One second per step plus one per prefill token: a prefill's time counts its new tokens.
    cost = CostModel(base=1.0, per_prefill_token=1.0, per_decode_seq=0.0, per_context_token=0.0)
    prefix = list(range(100, 132))  # 8 full blocks of 4
    groups = lambda: [  # noqa: E731
        group(0, prefix + [7, 8, 9, 10], 1, 0.0),
        group(1, prefix + [11, 12, 13, 14], 1, 100.0),  # arrives long after the first is done
    ]
    plain = simulate(None, cost, groups=groups(), num_gpu_blocks=32, block_size=4)
    assert [r.ttft for r in plain.requests] == [1.0 + 36, 1.0 + 36]
    kv = KVCacheManager(32, 4, enable_prefix_caching=True)
    cached = simulate(None, cost, groups=groups(), kv_manager=kv)
    # The second request finds the prefix's 8 blocks in the cache and computes only its own 4.
    assert [r.ttft for r in cached.requests] == [1.0 + 36, 1.0 + 4]


def test_parallel_samples_fork_in_the_engine_and_all_finish():
    served = group(0, [5, 6, 7, 8, 9], max_tokens=6, arrival=0.0, n=3)
    result = simulate(None, UNIT, groups=[served], num_gpu_blocks=32, block_size=4,
                      record_steps=True)
    # The forks decode alongside the first sample: still one step per output token.
    assert result.num_steps == 6 and result.requests[0].jct == 6.0
    assert result.requests[0].output_len == 6
    steps = result.steps
    assert [len(s.scheduled) for s in steps] == [1] + [3] * 5  # the prompt, then 3 samples
    assert len({w.seq_id for s in steps for w in s.scheduled}) == 3
    assert [step.num_running for step in steps] == [1] * 6


def test_bad_arguments_are_named():
    trace = [TraceRequest(0.0, 4, 2)]
    with pytest.raises(ValueError, match="exactly one of trace and groups"):
        simulate(trace, UNIT, groups=[group(0, [5, 6], 2, 0.0)], num_gpu_blocks=8)
    with pytest.raises(ValueError, match="exactly one of trace and groups"):
        simulate(None, UNIT, num_gpu_blocks=8)
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        simulate(trace, UNIT)
    with pytest.raises(ValueError, match="distinct request_id"):
        simulate(None, UNIT, groups=[group(0, [5], 1, 0.0), group(0, [6], 1, 0.0)],
        num_gpu_blocks=8)


def test_gamma_arrivals_have_the_asked_for_rate_and_burstiness():
    rng = np.random.default_rng(0)
    for cv in (1.0, 3.0):
        gaps = np.diff(gamma_arrival_times(20_000, 4.0, cv, rng))
        assert gaps.mean() == pytest.approx(0.25, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)
    with pytest.raises(ValueError, match="cv"):
        gamma_arrival_times(3, 1.0, 0.0, rng)
    trace = [TraceRequest(0.0, 3, 4)] * 3
    assert [r.arrival_time for r in with_arrivals(trace, np.array([0.0, 1.0, 2.5]))] == [
        0.0,
        1.0,
        2.5,
    ]


def test_heavy_tailed_traces_with_log_normal_prompts():
    default = heavy_tailed(2000, seed=1)
    long = heavy_tailed(2000, seed=1, prompt_median=300, max_seq_len=1024)
    prompts = np.array([r.prompt_len for r in long])
    assert np.median(prompts) == pytest.approx(300, rel=0.1)
    assert np.median([r.prompt_len for r in default]) < 100  # ShareGPT-like: mostly short
    for trace, limit in ((default, 2048), (long, 1024)):
        assert all(r.prompt_len >= 1 and r.output_len >= 1 for r in trace)
        assert max(r.total_len for r in trace) <= limit
    outputs = np.array([r.output_len for r in default])
    assert outputs.mean() > 2 * np.median(outputs)  # heavy tail: the mean well above the median


# -- the simulator against the real engine --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama_parts(
        vocab_size=96, hidden_size=64, intermediate_size=128, max_position_embeddings=512
    )


class CostClock:
    """Time as a cost model tells it: every step the engine reports moves the clock on by the
    step's predicted duration (`step_duration`, as the simulator charges it)."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def observe(self, record) -> None:
        swapped = len(record.plan.swap_in) + len(record.plan.swap_out)
        self.now += step_duration(self.cost, record.shape, swapped,
        record.plan.num_swap_blocks_ahead)


def work(record) -> tuple:
    """What a step computed and moved, in terms both drivers record the same way."""
    computed = [(w.request_id, w.start, w.num_new_tokens, w.is_prefill) for w in record.scheduled]
    return computed, len(record.plan.swap_in), len(record.plan.swap_out), record.plan.preempted


# A step costs ~ms, a prompt token ~0.1 ms: skip-join sends long prompts to lower queues.
REPLAY_COST = CostModel(2e-3, 1e-4, 2e-4, 5e-6, per_swap_block=1e-4)


@pytest.mark.parametrize("policy", ["fcfs", "mlfq"])
def test_the_simulator_makes_the_real_engines_decisions(tiny, policy):
    """Same trace, same scheduler settings, and the engine's clock running on the cost model's
    time: the simulator predicts every request's preemptions and its first and last token to
    the float, and the engine's steps batch exactly the work the simulator's did. (How well a
    profiled cost model predicts wall time is measured in benchmarks/papers/fastserve.py, not here.)
    The cache is small enough that requests are preempted and swapped."""
    engine_config = dict(
        num_gpu_blocks=24,
        num_cpu_blocks=64,
        block_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        preemption_mode="swap",
    )
    factory = FCFSScheduler
    if policy == "mlfq":
        mlfq = MLFQConfig(base_quantum=2e-3, starvation_bound=0.05)
        factory = mlfq_factory(mlfq, REPLAY_COST)
        engine_config.update(scheduler="mlfq", mlfq=mlfq, cost_model=REPLAY_COST)
    clock = CostClock(REPLAY_COST)
    model, model_config = tiny
    engine = LLMEngine(model, model_config, None, EngineConfig(**engine_config), clock=clock)
    engine.add_step_observer(clock.observe)
    rng = np.random.default_rng(0)
    arrivals = poisson_arrival_times(40, 100.0, rng)
    trace = [
        TraceRequest(float(t), int(rng.integers(4, 64)), int(rng.integers(2, 48))) for t in arrivals
    ]
    measured = replay_on_engine(engine, trace)
    simulated = simulate(
        trace,
        REPLAY_COST,
        factory,
        num_gpu_blocks=24,
        block_size=8,
        num_cpu_blocks=64,
        config=engine.scheduler.config,
        record_steps=True,
    )
    assert measured.num_preemptions > 0 and measured.swapped_out_blocks > 0  # the hard paths ran
    if policy == "mlfq":  # jobs moved between queues
        assert len({level for s in measured.steps for level in s.levels.values()}) > 1
    assert [r.output_len for r in measured.requests] == [r.output_len for r in trace]
    assert [work(s) for s in measured.steps] == [work(s) for s in simulated.steps]
    for real, predicted in zip(measured.requests, simulated.requests, strict=True):
        assert real.num_preemptions == predicted.num_preemptions
        assert real.first_token_time == pytest.approx(predicted.first_token_time, abs=1e-9)
        assert real.finished_time == pytest.approx(predicted.finished_time, abs=1e-9)
