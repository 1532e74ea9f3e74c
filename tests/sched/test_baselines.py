"""The baselines under the real schedulers, and the scheduler registry that builds every system.

* A hypothesis-driven run of random requests through `OrcaScheduler` / `StaticBatchScheduler`
  keeps the reservation manager's invariants after every step, finishes every request with
  exactly its tokens and gives all memory back; static batching never admits into a running
  batch. (The reservations themselves: tests/kv/test_reservation.py.)
* In the engine, a baseline's contiguous block tables give the same greedy tokens as the dense
  model (the chunks are real, disjoint regions of the KV tensor).
* `build_scheduler` builds every name at the capacity asked for.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import assert_engine_drained, tiny_engine, tiny_llama_parts

from minipaged.kv.reservation import ReservationKVCacheManager
from minipaged.sampling.params import SamplingParams
from minipaged.sampling.sequence import Sequence, SequenceGroup
from minipaged.sampling.stopping import check_stop
from minipaged.sched.base import SchedulerConfig
from minipaged.sched.baselines import OrcaScheduler, StaticBatchScheduler
from minipaged.sched.cost_model import CostModel
from minipaged.sched.mlfq import MLFQ_VARIANTS, MLFQConfig, SkipJoinMLFQScheduler
from minipaged.sched.registry import SCHEDULERS, build_scheduler, needs_cost_model
from minipaged.testing.dense import generate_dense

MAX_LEN = 64
# The five systems of the vLLM paper's Fig. 12, by their registry names.
SYSTEMS = ("static", "orca-max", "orca-pow2", "orca-oracle", "fcfs")
_ids = iter(range(10**9))


def make_group(prompt_len: int, max_tokens: int, width: int = 1) -> SequenceGroup:
    seq_id = next(_ids)
    seq = Sequence(seq_id, [5 + (seq_id + i) % 40 for i in range(prompt_len)])
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if width > 1:
        params = SamplingParams(temperature=1.0, n=width, max_tokens=max_tokens, ignore_eos=True)
    return SequenceGroup(f"r{seq_id}", [seq], params, arrival_time=float(seq_id))


def run_step(scheduler) -> None:
    """The engine around the model, with made-up tokens; then the adapter's invariants."""
    out = scheduler.schedule(0.0)
    for item in out.scheduled:
        table = scheduler.kv_manager.block_table(item.seq_id)
        assert item.block_table == tuple(table)  # the step's tables ride on its output
        assert len(table) * scheduler.kv_manager.block_size >= item.start + item.num_new_tokens
    scheduler.mark_computed(out)
    sampling = [item for item in out.scheduled if item.needs_logits]
    for group, seq in scheduler.resolve(sampling):
        seq.append_token(3, -0.5)
        decision = check_stop(seq, group.sampling_params)
        if decision is not None:
            seq.finish(decision)
    scheduler.finish_step()
    scheduler.kv_manager.check_invariants()


# -- under the schedulers -------------------------------------------------------------------------

request_lists = st.lists(
    st.tuples(st.integers(1, 30), st.integers(1, 30), st.integers(0, 3)),  # prompt, output, at
    min_size=1,
    max_size=14,
)


def serve(scheduler, requests, added: list[str] | None = None) -> list[SequenceGroup]:
    """Add each request at its step (appending its id to `added`), step until all finished."""
    groups = [(at, make_group(p, o)) for p, o, at in requests]
    pending = sorted(groups, key=lambda g: g[0])
    step = 0
    while pending or scheduler.has_unfinished():
        while pending and pending[0][0] <= step:
            group = pending.pop(0)[1]
            scheduler.add(group)
            if added is not None:
                added.append(group.request_id)
        run_step(scheduler)
        step += 1
        assert step < 5000, "no progress"
    return [g for _, g in groups]


@settings(max_examples=20)
@given(
    policy=st.sampled_from(["max", "pow2", "oracle"]),
    block_size=st.sampled_from([1, 4, 16]),
    requests=request_lists,
    budget=st.sampled_from([8, 64]),
)
def test_orca_serves_every_request_and_returns_all_memory(policy, block_size, requests, budget):
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=6, max_model_len=MAX_LEN)
    kv = ReservationKVCacheManager(192 // block_size, block_size, policy, MAX_LEN)
    scheduler = OrcaScheduler(config, kv)
    groups = serve(scheduler, requests)
    for group, (_, output_len, _) in zip(groups, requests, strict=True):
        assert group.seqs[0].get_output_len() == output_len
    assert scheduler.num_preemptions == 0  # a reservation is never outgrown
    assert kv.num_free_blocks == kv.num_gpu_blocks and not kv.seq_ids()
    starts = [g.metrics.first_scheduled_time for g in groups]
    assert all(s is not None for s in starts)


@settings(max_examples=20)
@given(requests=request_lists, rows=st.integers(1, 3), block_size=st.sampled_from([1, 8]))
def test_static_batching_never_admits_into_a_running_batch(requests, rows, block_size):
    config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=MAX_LEN)
    kv = ReservationKVCacheManager(rows * MAX_LEN // block_size, block_size, "max", MAX_LEN)
    scheduler = StaticBatchScheduler(config, kv)
    batches: list[set[str]] = []
    schedule = scheduler.schedule

    def schedule_and_check(now: float):
        before = {g.request_id for g in scheduler.running}  # the batch still running
        out = schedule(now)
        running = {g.request_id for g in scheduler.running}
        admitted = running - before
        if admitted:
            assert not before, f"{admitted} joined the running batch {before}"
            assert len(running) <= rows  # one max-length row each
            batches.append(running)
        return out

    scheduler.schedule = schedule_and_check
    added: list[str] = []
    groups = serve(scheduler, requests, added)
    assert all(g.is_finished() for g in groups)
    assert kv.num_free_blocks == kv.num_gpu_blocks
    # The batches partition the requests in the order they arrived (first come, first served).
    position = {rid: i for i, rid in enumerate(added)}
    assert [rid for b in batches for rid in sorted(b, key=position.get)] == added


def test_orca_max_admits_fewer_requests_than_oracle_at_equal_capacity():
    """The point of the baselines: at the same capacity, over-reservation limits the batch."""
    admitted = {}
    for policy in ("max", "pow2", "oracle"):
        config = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=MAX_LEN)
        scheduler = OrcaScheduler(config, ReservationKVCacheManager(256, 1, policy, MAX_LEN))
        for _ in range(20):
            scheduler.add(make_group(6, 10))  # 16 slots each
        scheduler.schedule(0.0)
        admitted[policy] = len(scheduler.running)
    assert admitted == {"max": 256 // 64, "pow2": 256 // 32, "oracle": 256 // 16}


# -- in the engine --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama_parts(max_position_embeddings=MAX_LEN, initializer_range=0.3)


@pytest.mark.parametrize("system", SYSTEMS)
def test_engine_greedy_tokens_equal_dense_under_every_system(tiny, system):
    model, _ = tiny
    engine = tiny_engine(
        tiny, num_gpu_blocks=40, block_size=4, num_cpu_blocks=0, seed=0, scheduler=system
    )
    assert type(engine.scheduler).__name__ == {
        "static": "StaticBatchScheduler",
        "fcfs": "FCFSScheduler",
    }.get(system, "OrcaScheduler")
    prompts = [[(7 * i + j) % 60 + 2 for j in range(3 + 5 * i % 17)] for i in range(6)]
    lengths = [5 + 3 * i for i in range(6)]
    ids = [
        engine.add_request(None, p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        for p, n in zip(prompts, lengths, strict=True)
    ]
    finals = engine.run_until_done()
    for request_id, prompt, n in zip(ids, prompts, lengths, strict=True):
        expected = generate_dense(model, [prompt], n)[0]
        assert finals[request_id].outputs[0].token_ids == expected
    assert_engine_drained(engine)


def test_every_system_is_built_at_the_capacity_asked_for():
    config = SchedulerConfig(max_model_len=MAX_LEN)
    for system in SCHEDULERS:
        scheduler = build_scheduler(system, config, num_gpu_blocks=48, block_size=4)
        assert scheduler.kv_manager.num_gpu_blocks == 48 and scheduler.kv_manager.block_size == 4
        assert scheduler.kv_manager.num_free_blocks == 48
        reservations = isinstance(scheduler.kv_manager, ReservationKVCacheManager)
        assert reservations == (system in SYSTEMS[:4])
        assert needs_cost_model(system) == (system in MLFQ_VARIANTS)
    with pytest.raises(ValueError, match="scheduler must be one of"):
        build_scheduler("vllm", config, num_gpu_blocks=64, block_size=1)


def test_the_registry_hands_mlfq_its_settings_and_cost_model_at_construction():
    config = SchedulerConfig(max_model_len=MAX_LEN)
    cost = CostModel(base=1e-3, per_prefill_token=1e-4, per_decode_seq=0.0, per_context_token=0)
    mlfq = MLFQConfig(num_levels=3, skip_join=False)
    scheduler = build_scheduler(
        "mlfq-naive", config, num_gpu_blocks=16, block_size=4, mlfq=mlfq, cost_model=cost
    )
    assert isinstance(scheduler, SkipJoinMLFQScheduler)
    assert scheduler.mlfq == mlfq and scheduler.cost_model is cost
    default = build_scheduler("mlfq-fixed", config, num_gpu_blocks=16, block_size=4)
    assert default.mlfq == MLFQ_VARIANTS["mlfq-fixed"].mlfq and default.cost_model is None
    with pytest.raises(ValueError, match="MLFQ scheduler"):
        build_scheduler("fcfs", config, num_gpu_blocks=16, block_size=4, mlfq=mlfq)
