"""Skip-join MLFQ (FastServe §4) as pure logic: hand-built cases for each rule, random traces
for the guarantees (everyone finishes, bounded waits, budgets, KV invariants), and the real
engine's greedy outputs under every MLFQ variant equal to FCFS's."""

from __future__ import annotations

import dataclasses
import random

import pytest
from fake_sampling import assert_queues_follow_status, sample_made_up_tokens
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import assert_engine_drained, tiny_engine, tiny_llama_parts

from minipaged.engine import engine as engine_module
from minipaged.kv.manager import KVCacheManager
from minipaged.sampling.params import SamplingParams
from minipaged.sampling.sequence import Sequence, SequenceGroup, SequenceStatus
from minipaged.sched.base import PreemptionMode, SchedulerConfig, SchedulerOutput
from minipaged.sched.cost_model import CostModel, step_shape
from minipaged.sched.mlfq import (
    MLFQ_VARIANTS,
    MLFQConfig,
    SkipJoinMLFQScheduler,
)
from minipaged.sched.registry import needs_cost_model

BLOCK = 4
MS = 2.0**-10  # about a millisecond, exact in binary: sums of whole "ms" compare exactly
# 1 ms per step plus 1 ms per prefill token: a prompt of p tokens predicts p + 1 ms.
COST = CostModel(base=1 * MS, per_prefill_token=1 * MS, per_decode_seq=0.0, per_context_token=0.0)


def make_scheduler(
    mlfq: MLFQConfig | None = None, num_gpu_blocks=64, num_cpu_blocks=64, cost=COST, **config
) -> SkipJoinMLFQScheduler:
    config.setdefault("max_model_len", 256)
    kv = KVCacheManager(num_gpu_blocks, BLOCK, num_cpu_blocks=num_cpu_blocks)
    return SkipJoinMLFQScheduler(SchedulerConfig(**config), kv, mlfq or MLFQConfig(), cost)


_ids = iter(range(10**9))


def make_group(prompt_len: int, max_tokens: int, arrival: float = 0.0) -> SequenceGroup:
    seq_id = next(_ids)
    seq = Sequence(seq_id, [7 + (seq_id * 13 + i) % 50 for i in range(prompt_len)])
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return SequenceGroup(f"r{seq_id}", [seq], params, arrival_time=arrival)


class Driver:
    """The engine's loop without a model: each step lasts what `COST` says, tokens made up."""

    def __init__(self, scheduler: SkipJoinMLFQScheduler, cost: CostModel = COST) -> None:
        self.scheduler = scheduler
        self.cost = cost
        self.now = 0.0
        self.steps: list[tuple[float, float, SchedulerOutput]] = []  # (start, end, output)
        self.gpu: dict[int, list[int | None]] = {}  # block -> the token in each slot
        self.cpu: dict[int, list[int | None]] = {}

    def step(self) -> SchedulerOutput:
        scheduler = self.scheduler
        out = scheduler.schedule(self.now)
        for item in out.scheduled:
            table = scheduler.kv_manager.block_table(item.seq_id)
            assert item.block_table == tuple(table)  # the step's tables ride on its output
            assert len(table) * BLOCK >= item.start + item.num_new_tokens
            assert not scheduler.kv_manager.is_swapped(item.seq_id)
        self.check_cache_contents(out)
        scheduler.mark_computed(out)
        start = self.now
        self.now += max(self.cost.step_time(step_shape(out.scheduled)), 1 * MS)
        sample_made_up_tokens(scheduler, out)
        scheduler.finish_step()
        assert_queues_follow_status(scheduler)
        self.steps.append((start, self.now, out))
        return out

    def check_cache_contents(self, out: SchedulerOutput) -> None:
        """Replay the step's copies in the runner's order (swap-outs, swap-ins, copy-on-write)
        on a shadow of which token each slot holds; every scheduled sequence must then find its
        context in its blocks, whatever was swapped, shared or recomputed on the way."""
        empty = [None] * BLOCK
        for gpu, cpu in out.swap_out:
            self.cpu[cpu] = list(self.gpu.get(gpu, empty))
        for cpu, gpu in out.swap_in:
            self.gpu[gpu] = list(self.cpu.get(cpu, empty))
        for src, dst in out.copy:
            self.gpu[dst] = list(self.gpu.get(src, empty))
        writes = []
        resolved = self.scheduler.resolve(out.scheduled)
        for item, (_, seq) in zip(out.scheduled, resolved, strict=True):
            tokens = seq.token_ids
            table = item.block_table
            for pos in range(item.start):
                assert self.gpu.get(table[pos // BLOCK], empty)[pos % BLOCK] == tokens[pos]
            for pos in range(item.start, item.start + item.num_new_tokens):
                writes.append((table[pos // BLOCK], pos % BLOCK, tokens[pos]))
        for block, offset, token in writes:
            self.gpu.setdefault(block, [None] * BLOCK)[offset] = token

    def run(self, max_steps: int = 20_000) -> None:
        while self.scheduler.has_unfinished():
            self.step()
            assert len(self.steps) < max_steps, "no progress"


def level_of(scheduler: SkipJoinMLFQScheduler, group: SequenceGroup) -> int:
    return scheduler.jobs[group.request_id].level


def scheduled_requests(out: SchedulerOutput) -> list[str]:
    return list(dict.fromkeys(s.request_id for s in out.scheduled))


# -- hand-built cases -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt_len, expected_level",
    # prefill = prompt + 1 ms; quanta 10, 20, 40, 80 ms: the first quantum >= the prefill
    [(1, 0), (9, 0), (10, 1), (19, 1), (20, 2), (39, 2), (60, 3), (200, 3)],
)
def test_skip_join_enters_the_first_queue_whose_quantum_covers_the_prefill(
    prompt_len, expected_level
):
    mlfq = MLFQConfig(num_levels=4, base_quantum=10 * MS)
    scheduler = make_scheduler(mlfq, max_model_len=512, num_gpu_blocks=128)
    group = make_group(prompt_len, 1)
    scheduler.add(group)
    assert level_of(scheduler, group) == expected_level
    naive = make_scheduler(MLFQConfig(num_levels=4, skip_join=False), max_model_len=512)
    naive.add(other := make_group(prompt_len, 1))
    assert level_of(naive, other) == 0


def test_skip_join_needs_a_cost_model():
    kv = KVCacheManager(16, BLOCK)
    scheduler = SkipJoinMLFQScheduler(SchedulerConfig(max_model_len=64), kv, MLFQConfig())
    with pytest.raises(ValueError, match="cost model"):
        scheduler.add(make_group(4, 1))


def test_bad_mlfq_config_is_rejected():
    with pytest.raises(ValueError, match="base_quantum"):
        MLFQConfig(base_quantum=0)
    # A variant standing for recomputation cannot run with a config that asks for swapping.
    recompute = MLFQ_VARIANTS["mlfq-recompute"].factory(COST)
    kv = KVCacheManager(16, BLOCK)
    with pytest.raises(ValueError, match="preempts by recompute"):
        recompute(SchedulerConfig(max_model_len=64, preemption_mode="swap"), kv)
    scheduler = recompute(SchedulerConfig(max_model_len=64), kv)
    assert scheduler.config.preemption_mode is PreemptionMode.RECOMPUTE


def test_mlfq_preempts_by_the_config_s_mode_and_swaps_by_default():
    """Every scheduler reads the one preemption mode of its config; MLFQ's default is
    FastServe's: swap, even a single sequence (vLLM's FCFS would recompute it)."""
    group = make_group(4, 10)
    for mode, expected in [(None, PreemptionMode.SWAP), ("recompute", PreemptionMode.RECOMPUTE),
                           ("swap", PreemptionMode.SWAP)]:
        scheduler = make_scheduler(preemption_mode=mode)
        assert scheduler.preemption_mode(group) is expected


def test_a_job_is_demoted_after_its_quantum_and_a_newcomer_overtakes_it():
    # One sequence per step: the scheduler must choose.
    scheduler = make_scheduler(MLFQConfig(base_quantum=5 * MS), max_num_seqs=1)
    driver = Driver(scheduler)
    long = make_group(2, 50)
    scheduler.add(long)  # prefill 3 ms <= 5 ms: Q1
    assert level_of(scheduler, long) == 0
    while level_of(scheduler, long) == 0:
        driver.step()
    # The schedule() that began the last step demoted it: the steps before used Q1's quantum,
    # and the steps before those had not.
    durations = [end - start for start, end, _ in driver.steps[:-1]]
    assert sum(durations) >= 5 * MS > sum(durations[:-1])
    assert level_of(scheduler, long) == 1
    short = make_group(2, 2, arrival=driver.now)
    scheduler.add(short)
    out = driver.step()
    assert scheduled_requests(out) == [short.request_id]  # Q1 beats Q2
    # The preempted job kept its blocks in the GPU pool.
    assert (
        long.seqs[0].status is SequenceStatus.RUNNING and long.seqs[0].seq_id in
        scheduler.kv_manager
    )
    assert not scheduler.kv_manager.is_swapped(long.seqs[0].seq_id)
    driver.run()
    assert long.is_finished() and short.is_finished()
    assert scheduler.num_demotions >= 1


@pytest.mark.parametrize(
    "prompt_len, expected_level",
    # quanta 10, 20, 40, 80, 160 ms; a prefill takes prompt + 1 ms. After its prefill in Q1 the
    # job belongs where skip-join would have put it: the first queue whose quantum covers the
    # time it used, not merely the next queue (it would then outrank jobs that have received
    # far less service than it). An ordinary exhausted quantum still demotes by one.
    [(12, 1), (25, 2), (60, 3), (100, 4), (200, 4)],
)
def test_one_iteration_longer_than_several_quanta_demotes_several_levels(
    prompt_len, expected_level
):
    mlfq = MLFQConfig(num_levels=5, base_quantum=10 * MS, skip_join=False)
    scheduler = make_scheduler(mlfq, max_model_len=512, num_gpu_blocks=128)
    driver = Driver(scheduler)
    job = make_group(prompt_len, 20)
    scheduler.add(job)
    assert level_of(scheduler, job) == 0  # naive MLFQ: everyone enters Q1
    driver.step()  # the prefill: one iteration of prompt + 1 ms
    driver.step()  # its schedule() charges the prefill
    assert level_of(scheduler, job) == expected_level
    assert scheduler.num_demotions == 1
    skip_join = make_scheduler(MLFQConfig(num_levels=5, base_quantum=10 * MS), max_model_len=512)
    skip_join.add(same := make_group(prompt_len, 20))
    assert level_of(skip_join, same) == expected_level  # the level skip-join gives it up front


def test_skip_join_runs_short_jobs_before_a_long_prefill_that_naive_mlfq_runs_first():
    """Notebook 07's toy, by hand: one job per step, a step of 1 ms plus 0.25 ms per prompt
    token, quanta 2, 4, 8, 16 ms. Skip-join puts the 40-token prompt (an 11 ms prefill) in Q4:
    the short jobs' prefills (2 ms, Q1) run first, job 1 then uses Q2's 4 ms and finishes in
    Q3, and the long job runs last (13-26). Naive MLFQ runs the long prefill first (0-11) and
    demotes that job straight to Q4, where skip-join put it; the rest follows 11 ms later."""
    cost = CostModel(
        base=1 * MS, per_prefill_token=0.25 * MS, per_decode_seq=0.0, per_context_token=0.0
    )
    for skip_join, levels, finish_ms in [
        (True, [3, 0, 0, 0], [26, 13, 11, 12]),
        (False, [0, 0, 0, 0], [26, 24, 22, 23]),
    ]:
        mlfq = MLFQConfig(
            num_levels=4, base_quantum=2 * MS, starvation_bound=None, skip_join=skip_join
        )
        scheduler = make_scheduler(mlfq, cost=cost, max_num_seqs=1, enable_chunked_prefill=False)
        jobs = [make_group(40, 3), make_group(4, 6), make_group(4, 2), make_group(4, 2)]
        for job in jobs:
            scheduler.add(job)
        assert [level_of(scheduler, job) for job in jobs] == levels
        driver = Driver(scheduler, cost)
        driver.run()
        last = {rid: end for _, end, out in driver.steps for rid in scheduled_requests(out)}
        assert [last[job.request_id] / MS for job in jobs] == finish_ms, skip_join


def test_a_starving_job_is_promoted_to_the_front_of_q1():
    bound = 30 * MS
    mlfq = MLFQConfig(base_quantum=2 * MS, starvation_bound=bound, num_levels=4)
    scheduler = make_scheduler(mlfq, max_num_seqs=1)
    driver = Driver(scheduler)
    victim = make_group(2, 40)
    scheduler.add(victim)
    while level_of(scheduler, victim) < 2:  # let it sink
        driver.step()
    last_served = driver.now  # the end of its last step so far
    # A stream of short jobs keeps Q1 busy: each arrives as the previous one finishes.
    promoted_at = None
    for _ in range(200):
        if not any(g is not victim for g in scheduler.groups()):
            scheduler.add(make_group(1, 1, arrival=driver.now))
        start = driver.now
        out = driver.step()
        if victim.request_id in scheduled_requests(out):
            promoted_at = start
            break
    assert promoted_at is not None
    assert scheduler.num_promotions >= 1
    # It ran in the first step that began after it had waited longer than the bound.
    assert promoted_at - last_served > bound
    step_before = max(s for s, _, _ in driver.steps if s < promoted_at)
    assert step_before - last_served <= bound
    assert level_of(scheduler, victim) == 0


def test_fixed_priority_never_changes_levels():
    scheduler = make_scheduler(MLFQ_VARIANTS["mlfq-fixed"].mlfq, max_num_seqs=2)
    driver = Driver(scheduler)
    groups = [make_group(p, 30) for p in (2, 15, 30)]
    for g in groups:
        scheduler.add(g)
    entry = [level_of(scheduler, g) for g in groups]
    assert entry == [0, 1, 2]
    for _ in range(40):
        driver.step()
        for g, level in zip(groups, entry, strict=True):
            if not g.is_finished():
                assert level_of(scheduler, g) == level
    assert scheduler.num_demotions == scheduler.num_promotions == 0


def test_proactive_swapping_keeps_the_reserve_and_swaps_in_ahead():
    mlfq = MLFQConfig(base_quantum=2 * MS, reserve_blocks=3)
    scheduler = make_scheduler(mlfq, num_gpu_blocks=12, num_cpu_blocks=32, max_num_seqs=2)
    driver = Driver(scheduler)
    for _ in range(5):
        scheduler.add(make_group(6, 12))
    ahead = 0
    while scheduler.has_unfinished():
        out = driver.step()
        ahead += out.num_swap_blocks_ahead
        batch = scheduled_requests(out)
        residents_not_running = [g for g in scheduler.running if g.request_id not in batch]
        # Below the reserve only when no idle resident was left to swap out (or the step
        # swapped in: no swap-out may follow a swap-in within a step).
        if scheduler.kv_manager.num_free_blocks < 3 and not out.swap_in:
            assert not residents_not_running
        scheduler.kv_manager.check_invariants()
    assert ahead > 0 and scheduler.num_swap_blocks_ahead == ahead
    assert scheduler.kv_manager.num_free_blocks == 12


# FastServe's three ways of making room (§4.2, §6.3), as the variants that stand for them.
MAKING_ROOM = ["mlfq", "mlfq-reactive", "mlfq-recompute"]


def variant_settings(name: str, **overrides) -> tuple[MLFQConfig, dict]:
    """A variant's MLFQ settings (with `overrides`) and the scheduler config it runs under."""
    variant = MLFQ_VARIANTS[name]
    return dataclasses.replace(variant.mlfq, **overrides), {
        "preemption_mode": variant.preemption_mode
    }


@pytest.mark.parametrize("variant", MAKING_ROOM)
def test_swap_policies_differ_in_how_they_make_room(variant):
    mlfq, config = variant_settings(variant, base_quantum=2 * MS, reserve_blocks=2)
    scheduler = make_scheduler(
        mlfq, num_gpu_blocks=10, num_cpu_blocks=40, max_num_seqs=2, **config
    )
    driver = Driver(scheduler)
    for _ in range(4):
        scheduler.add(make_group(6, 14))
    swapped_out = ahead = recomputed = 0
    while scheduler.has_unfinished():
        out = driver.step()
        swapped_out += len(out.swap_out)
        ahead += out.num_swap_blocks_ahead
        waiting = {g.request_id for g in scheduler.waiting}
        recomputed += sum(1 for request_id in out.preempted if request_id in waiting)
    if variant == "mlfq-recompute":
        assert swapped_out == 0 and recomputed > 0
    else:
        assert swapped_out > 0 and recomputed == 0
    assert (ahead > 0) == (variant == "mlfq")


def test_without_chunked_prefill_a_whole_prefill_must_fit_the_remaining_budget():
    # Budget 40 tokens; three 30-token prompts. A prefill is never split, so only one fits a
    # step (the bug this guards against scheduled 60 tokens: the budget check counted 1 token).
    scheduler = make_scheduler(
        MLFQConfig(skip_join=False),
        max_num_batched_tokens=40,
        max_num_seqs=8,
        max_model_len=40,
        enable_chunked_prefill=False,
    )
    groups = [make_group(30, 3) for _ in range(3)]
    for g in groups:
        scheduler.add(g)
    driver = Driver(scheduler)
    while scheduler.has_unfinished():
        out = driver.step()
        assert out.num_batched_tokens <= 40
        # Every prefill scheduled in one piece (the whole prompt), then one token at a time.
        for item in out.scheduled:
            assert (item.start, item.num_new_tokens) == (0, 30) or item.num_new_tokens == 1
    first = driver.steps[0][2]
    assert [s.num_new_tokens for s in first.scheduled] == [30]


def _memory_held_by_a_demoted_job(variant: str):
    """A cache of 12 blocks of 4 tokens; job `old` has sunk to Q3 and holds some of them.
    Returns (scheduler, driver, old, free blocks)."""
    mlfq, config = variant_settings(
        variant,
        base_quantum=2 * MS,
        skip_join=False,  # a new job enters Q1 whatever its prompt
        reserve_blocks=0,
        num_levels=4,
        starvation_bound=None,
    )
    scheduler = make_scheduler(
        mlfq, num_gpu_blocks=12, num_cpu_blocks=32, max_num_seqs=4, max_model_len=48, **config
    )
    driver = Driver(scheduler)
    old = make_group(3, 30)
    scheduler.add(old)
    while level_of(scheduler, old) < 2:
        driver.step()
    return scheduler, driver, old, scheduler.kv_manager.num_free_blocks


def _bigger_than(free_blocks: int, arrival: float) -> SequenceGroup:
    """A new job whose prompt needs one block more than is free."""
    prompt = BLOCK * free_blocks + 1
    return make_group(prompt, min(10, 47 - prompt), arrival=arrival)


@pytest.mark.parametrize("variant", ["mlfq-reactive", "mlfq-recompute"])
def test_a_new_job_evicts_only_jobs_of_strictly_lower_queues(variant):
    scheduler, driver, old, free = _memory_held_by_a_demoted_job(variant)
    new = _bigger_than(free, driver.now)
    scheduler.add(new)  # Q1, above `old` in Q3: `old` makes room
    out = driver.step()
    assert scheduled_requests(out) == [new.request_id] and out.preempted == [old.request_id]
    # The same job entering Q3 itself, even ahead of `old` in that queue, may not evict it.
    scheduler, driver, old, free = _memory_held_by_a_demoted_job(variant)
    peer = _bigger_than(free, driver.now)
    scheduler.add(peer)
    scheduler.jobs[peer.request_id].level = level_of(scheduler, old)
    scheduler.jobs[peer.request_id].order = -1  # first in the queue
    out = driver.step()
    assert not out.preempted and scheduled_requests(out) == [old.request_id]


@pytest.mark.parametrize("variant", ["mlfq-reactive", "mlfq-recompute"])
def test_a_preempted_job_returns_when_its_blocks_fit_without_evicting_others(variant):
    scheduler, driver, old, free = _memory_held_by_a_demoted_job(variant)
    new = _bigger_than(free, driver.now)
    scheduler.add(new)
    driver.step()
    assert old.seqs[0].status is not SequenceStatus.RUNNING  # swapped or waiting
    # `new` sinks to Q3 behind `old` while it runs; `old`, now ahead of it, does not evict it
    # to come back: it waits until `new` has finished and freed its blocks.
    while not new.is_finished():
        out = driver.step()
        assert new.request_id in scheduled_requests(out)
        assert not out.preempted
    assert level_of(scheduler, old) <= 2
    driver.run()
    assert old.is_finished()
    assert not scheduler.jobs
    assert scheduler.kv_manager.num_free_blocks == scheduler.kv_manager.num_gpu_blocks


def test_quanta_sized_to_a_cost_model_start_at_the_shortest_iteration():
    cost = CostModel(
        base=17e-3, per_prefill_token=1e-4, per_decode_seq=2e-4, per_context_token=1e-6
    )
    mlfq = MLFQConfig.sized_to(cost, num_levels=3)
    assert mlfq.base_quantum == pytest.approx(17e-3 + 1e-4)  # a one-token prefill
    assert mlfq.num_levels == 3 and mlfq.quantum(2) == pytest.approx(4 * mlfq.base_quantum)


# -- random traces --------------------------------------------------------------------------------

jobs_strategy = st.lists(
    st.tuples(st.integers(1, 24), st.integers(1, 16), st.integers(0, 30)),  # prompt, out, arrival
    min_size=1,
    max_size=8,
)


@given(
    jobs=jobs_strategy,
    variant=st.sampled_from(sorted(MLFQ_VARIANTS)),
    num_gpu_blocks=st.integers(10, 24),
    num_cpu_blocks=st.sampled_from([0, 6, 40]),
    token_budget=st.integers(4, 32),
    chunked=st.booleans(),
)
@settings(max_examples=60)
def test_random_traces_finish_within_budgets_and_invariants(
    jobs, variant, num_gpu_blocks, num_cpu_blocks, token_budget, chunked
):
    if not chunked:  # a whole prefill must fit one step
        token_budget = max(token_budget, 64)
    mlfq, config = variant_settings(variant, base_quantum=2 * MS, reserve_blocks=2)
    if mlfq.starvation_bound is not None:
        mlfq.starvation_bound = 40 * MS
    scheduler = make_scheduler(
        mlfq,
        **config,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        max_num_seqs=3,
        max_num_batched_tokens=token_budget,
        max_model_len=64,
        enable_chunked_prefill=chunked,
    )
    driver = Driver(scheduler)
    pending = sorted(
        ((arrival * MS, make_group(p, o, arrival * MS)) for p, o, arrival in jobs),
        key=lambda x: x[0],
    )
    admitted = []
    while pending or scheduler.has_unfinished():
        while pending and pending[0][0] <= driver.now:
            _, group = pending.pop(0)
            try:
                scheduler.add(group)
                admitted.append(group)
            except ValueError:
                pass  # cannot fit this cache: rejected untouched
        if not scheduler.has_unfinished():
            driver.now = pending[0][0]
            continue
        out = driver.step()
        assert out.num_batched_tokens <= token_budget
        assert len(out.scheduled) <= 3
        assert len({s.seq_id for s in out.scheduled}) == len(out.scheduled)
        scheduler.kv_manager.check_invariants()
        for group in scheduler.running:
            assert all(s.seq_id in scheduler.kv_manager for s in group.get_unfinished_seqs())
        assert len(driver.steps) < 5000, "no progress"
    for group in admitted:
        assert group.is_finished()
        assert group.seqs[0].get_output_len() == group.sampling_params.max_tokens
    assert scheduler.kv_manager.num_free_blocks == num_gpu_blocks
    assert not scheduler.jobs


@given(jobs=jobs_strategy, num_gpu_blocks=st.integers(12, 24))
@settings(max_examples=40)
def test_no_job_waits_past_the_starvation_bound_plus_one_quantum(jobs, num_gpu_blocks):
    """Waits between a job's steps are bounded when memory, not the batch, is short.

    The batch has room for every job (seqs and tokens), so only the KV cache keeps jobs out; a
    promoted job leads Q1 and preempts whoever holds the blocks it needs. It is scheduled in
    the first step that starts after the bound has passed, so it waits at most the bound plus
    one step, and no step is longer than Q1's quantum here.
    """
    bound = 30 * MS
    mlfq = MLFQConfig(base_quantum=200 * MS, starvation_bound=bound, reserve_blocks=2)
    scheduler = make_scheduler(
        mlfq,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=64,
        max_num_seqs=8,
        max_num_batched_tokens=8 * 24,
        max_model_len=64,
    )
    driver = Driver(scheduler)
    groups = [make_group(p, o, arrival * MS) for p, o, arrival in jobs]
    pending = sorted(groups, key=lambda g: g.arrival_time)
    while pending or scheduler.has_unfinished():
        while pending and pending[0].arrival_time <= driver.now:
            scheduler.add(pending.pop(0))
        if not scheduler.has_unfinished():
            driver.now = pending[0].arrival_time
            continue
        driver.step()
        assert len(driver.steps) < 5000
    longest_step = max(end - start for start, end, _ in driver.steps)
    assert longest_step <= mlfq.base_quantum
    for group in groups:
        rid = group.request_id
        served = [(s, e) for s, e, out in driver.steps if rid in scheduled_requests(out)]
        starts, ends = [s for s, _ in served], [e for _, e in served]
        served_until = [group.arrival_time] + ends[:-1]
        for waited_from, start in zip(served_until, starts, strict=True):
            assert start - waited_from <= bound + mlfq.base_quantum + 1e-9


# -- the real engine: MLFQ changes the order, never the tokens ------------------------------------

VOCAB = 96


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama_parts(vocab_size=VOCAB, initializer_range=0.3, eos_token_id=1)


@pytest.fixture(scope="module", autouse=True)
def no_profiling():
    """The engine measures a cost model for MLFQ; these tests check tokens, not timing."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module, "profile_runner", lambda *args, **kwargs: COST)
        yield


def greedy(tiny, scheduler: str, prompts, max_tokens, **kwargs) -> list[list[int]]:
    kwargs.setdefault("num_gpu_blocks", 128)
    engine = tiny_engine(
        tiny, num_cpu_blocks=64, block_size=8, max_num_seqs=4, scheduler=scheduler, **kwargs
    )
    if needs_cost_model(scheduler):
        # Tiny quanta, so that demotions, promotions and swaps all happen on a short trace.
        engine.scheduler.mlfq.base_quantum = 1e-4
        if engine.scheduler.mlfq.starvation_bound is not None:
            engine.scheduler.mlfq.starvation_bound = 5e-3
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts]
    finals = engine.run_until_done()
    assert_engine_drained(engine)
    return [finals[i].outputs[0].token_ids for i in ids]


@given(seed=st.integers(0, 10**6), variant=st.sampled_from(sorted(MLFQ_VARIANTS)))
@settings(max_examples=6)
def test_greedy_outputs_under_mlfq_equal_fcfs(tiny, seed, variant):
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(8)]
    max_tokens = 10
    expected = greedy(tiny, "fcfs", prompts, max_tokens)
    # A small cache: jobs are preempted, swapped and recomputed on the way.
    assert greedy(tiny, variant, prompts, max_tokens, num_gpu_blocks=14) == expected


def test_the_engine_takes_a_ready_cost_model_and_mlfq_settings(tiny, monkeypatch):
    from minipaged.engine.config import EngineConfig

    def no_profile(*args, **kwargs):
        raise AssertionError("profiled although a cost model was given")

    monkeypatch.setattr(engine_module, "profile_runner", no_profile)
    mlfq = MLFQConfig.sized_to(COST, num_levels=3, skip_join=False)
    engine = tiny_engine(
        tiny, num_gpu_blocks=32, block_size=8, scheduler="mlfq", mlfq=mlfq, cost_model=COST
    )
    assert engine.scheduler.cost_model is COST
    assert engine.scheduler.mlfq == mlfq
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    request = engine.add_request(None, [5, 6, 7], params)
    assert len(engine.run_until_done()[request].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="MLFQ scheduler"):
        EngineConfig(scheduler="fcfs", mlfq=mlfq)
