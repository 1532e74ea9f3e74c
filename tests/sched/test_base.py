"""The FCFS scheduler as pure logic: no model, tokens made up, every invariant after every step."""

from __future__ import annotations

import pytest
from fake_sampling import sample_made_up_tokens
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from minipaged.kv.manager import KVCacheManager
from minipaged.sampling.params import SamplingParams
from minipaged.sampling.sequence import Sequence, SequenceGroup, SequenceStatus
from minipaged.sched.base import (
    PreemptionMode,
    RequestRejectedError,
    SchedulerConfig,
    SchedulerOutput,
)
from minipaged.sched.fcfs import FCFSScheduler

BLOCK = 4


def make_scheduler(num_gpu_blocks=32, num_cpu_blocks=32, **config) -> FCFSScheduler:
    config.setdefault("max_model_len", 256)
    kv = KVCacheManager(num_gpu_blocks, BLOCK, num_cpu_blocks=num_cpu_blocks)
    return FCFSScheduler(SchedulerConfig(**config), kv)


_ids = iter(range(10**9))


def make_group(prompt_len: int, max_tokens: int, request_id: str | None = None) -> SequenceGroup:
    seq_id = next(_ids)
    seq = Sequence(seq_id, [7 + (seq_id + i) % 50 for i in range(prompt_len)])
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return SequenceGroup(request_id or f"r{seq_id}", [seq], params, arrival_time=float(seq_id))


def run_step(scheduler: FCFSScheduler, now: float = 0.0) -> SchedulerOutput:
    """What the engine does around the model: compute (nothing), sample (a made-up token)."""
    out = scheduler.schedule(now)
    for item in out.scheduled:  # the table covers what the step writes
        table = scheduler.kv_manager.block_table(item.seq.seq_id)
        assert item.block_table == table  # the step's tables ride on its output
        assert len(table) * BLOCK >= item.start + item.num_new_tokens
    scheduler.mark_computed(out)
    sample_made_up_tokens(out)
    scheduler.finish_step()
    return out


def run_to_completion(scheduler: FCFSScheduler, max_steps: int = 10_000) -> int:
    steps = 0
    while scheduler.has_unfinished():
        run_step(scheduler)
        steps += 1
        assert steps < max_steps, "the scheduler stopped making progress"
    return steps


# -- hand-built cases -----------------------------------------------------------------------------


def test_first_come_first_served_admission():
    scheduler = make_scheduler(num_gpu_blocks=7)  # room for `first` and `second`, not `big`
    first, second = make_group(16, 2), make_group(4, 2)
    big = make_group(20, 2)
    scheduler.add(first)
    scheduler.add(big)
    scheduler.add(second)
    out = scheduler.schedule(0.0)
    # `big` does not fit beside `first`; `second` would, but may not overtake `big`.
    assert [s.group for s in out.scheduled] == [first]


def test_chunked_prefill_respects_the_token_budget_and_covers_the_prompt():
    scheduler = make_scheduler(max_num_batched_tokens=5)
    group = make_group(12, 1)
    scheduler.add(group)
    chunks = []
    while scheduler.has_unfinished():
        out = run_step(scheduler)
        assert out.num_batched_tokens <= 5
        chunks += [(s.start, s.num_new_tokens) for s in out.scheduled]
    assert chunks == [(0, 5), (5, 5), (10, 2)]
    assert group.seqs[0].get_output_len() == 1


@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, PreemptionMode.SWAP])
def test_preemption_takes_the_latest_arrival_and_resumes_it(mode):
    scheduler = make_scheduler(num_gpu_blocks=4, preemption_mode=mode)
    early, late = make_group(4, 6), make_group(4, 6)
    scheduler.add(early)
    scheduler.add(late)
    run_step(scheduler)  # both prefilled: one full block each
    out = run_step(scheduler)  # both take their second block: none left
    assert not out.preempted and scheduler.kv_manager.num_free_blocks == 0
    for _ in range(4):  # the second blocks fill up; the fourth step needs a third block
        out = run_step(scheduler)
    assert out.preempted == [late]
    assert [s.group for s in out.scheduled] == [early]
    expected_status = (
        SequenceStatus.SWAPPED if mode is PreemptionMode.SWAP else SequenceStatus.WAITING
    )
    assert late.seqs[0].status is expected_status
    if mode is PreemptionMode.SWAP:
        assert out.swap_out and late in scheduler.swapped
    run_to_completion(scheduler)
    assert early.seqs[0].get_output_len() == late.seqs[0].get_output_len() == 6
    assert late.metrics.num_preemptions >= 1
    # Recomputation re-finds the request's own blocks; that is not a prefix-cache hit.
    assert late.metrics.num_cached_tokens == 0
    assert scheduler.kv_manager.num_free_blocks == 4


def test_swapped_groups_come_back_before_new_admissions():
    scheduler = make_scheduler(num_gpu_blocks=4, preemption_mode=PreemptionMode.SWAP)
    early, late = make_group(4, 8), make_group(4, 8)
    scheduler.add(early)
    scheduler.add(late)
    while not scheduler.swapped:
        run_step(scheduler)
    newcomer = make_group(2, 1)
    scheduler.add(newcomer)
    while True:
        out = run_step(scheduler)
        if late.seqs[0].status is not SequenceStatus.SWAPPED:
            break
        assert newcomer not in [s.group for s in out.scheduled]  # may not overtake `late`
    assert out.swap_in  # `late` came back by swapping in, not by recomputation
    run_to_completion(scheduler)
    assert newcomer.is_finished() and late.seqs[0].get_output_len() == 8


def test_scheduled_sequences_carry_the_block_tables_the_step_will_find():
    """The tables on the output are the manager's once the step's swaps and copies are done,
    also in the step that swaps a preempted group back in."""
    scheduler = make_scheduler(num_gpu_blocks=4, preemption_mode=PreemptionMode.SWAP)
    early, late = make_group(4, 8), make_group(4, 8)
    scheduler.add(early)
    scheduler.add(late)
    swapped_in_steps = 0
    while scheduler.has_unfinished():
        out = scheduler.schedule(0.0)
        for item in out.scheduled:
            assert item.block_table == scheduler.kv_manager.block_table(item.seq.seq_id)
            assert len(item.block_table) * BLOCK >= item.start + item.num_new_tokens
        swapped_in_steps += bool(out.swap_in)
        scheduler.mark_computed(out)
        sample_made_up_tokens(out)
        scheduler.finish_step()
    assert swapped_in_steps >= 1


def test_requests_that_can_never_fit_are_rejected_untouched():
    scheduler = make_scheduler(num_gpu_blocks=8, max_model_len=64)
    with pytest.raises(RequestRejectedError, match="context"):
        scheduler.add(make_group(64, 1))
    with pytest.raises(RequestRejectedError, match="KV blocks"):
        scheduler.add(make_group(20, 30))
    assert not scheduler.has_unfinished()
    assert scheduler.kv_manager.num_free_blocks == 8


def test_abort_anywhere_returns_every_block():
    scheduler = make_scheduler(num_gpu_blocks=6, preemption_mode=PreemptionMode.SWAP)
    groups = [make_group(4, 10) for _ in range(3)]
    for g in groups:
        scheduler.add(g)
    for _ in range(6):
        run_step(scheduler)
    for g in groups:
        assert scheduler.abort(g.request_id) is g
        assert all(s.status is SequenceStatus.FINISHED_ABORTED for s in g.seqs)
    assert scheduler.abort("nobody") is None
    assert not scheduler.has_unfinished()
    scheduler.kv_manager.check_invariants()
    assert scheduler.kv_manager.num_free_blocks == 6
    assert scheduler.kv_manager.num_free_host_blocks == scheduler.kv_manager.num_cpu_blocks


# -- random traces --------------------------------------------------------------------------------


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, aborts and steps against a small cache."""

    config = dict(max_num_batched_tokens=12, max_num_seqs=4)

    @initialize(
        mode=st.sampled_from([None, "swap", "recompute"]), host_blocks=st.sampled_from([0, 8])
    )
    def start(self, mode, host_blocks):
        self.scheduler = make_scheduler(
            num_gpu_blocks=12, num_cpu_blocks=host_blocks, preemption_mode=mode, **self.config
        )
        self.live: list[str] = []

    @rule(prompt_len=st.integers(1, 20), max_tokens=st.integers(1, 10))
    def add(self, prompt_len, max_tokens):
        group = make_group(prompt_len, max_tokens)
        try:
            self.scheduler.add(group)
        except RequestRejectedError:
            return
        self.live.append(group.request_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(self.live))
        assert self.scheduler.abort(request_id) is not None
        self.live.remove(request_id)

    @rule()
    def step(self):
        out = run_step(self.scheduler)
        for group in {s.group for s in out.scheduled if s.group.is_finished()}:
            self.live.remove(group.request_id)
        assert out.num_batched_tokens <= self.config["max_num_batched_tokens"]
        assert len(out.scheduled) <= self.config["max_num_seqs"]
        assert len({s.seq.seq_id for s in out.scheduled}) == len(out.scheduled)

    @invariant()
    def allocator_consistent(self):
        self.scheduler.kv_manager.check_invariants()
        running = {s.seq_id for g in self.scheduler.running for s in g.seqs if not s.is_finished()}
        assert running <= set(self.scheduler.kv_manager.seq_ids())

    def teardown(self):
        run_to_completion(self.scheduler)
        assert self.scheduler.kv_manager.num_free_blocks == self.scheduler.kv_manager.num_gpu_blocks


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)


def test_without_chunked_prefill_a_whole_prefill_must_fit_the_budget():
    scheduler = make_scheduler(
        max_num_batched_tokens=40, max_model_len=40, enable_chunked_prefill=False
    )
    groups = [make_group(30, 2) for _ in range(3)]
    for g in groups:
        scheduler.add(g)
    while scheduler.has_unfinished():
        out = run_step(scheduler)
        assert out.num_batched_tokens <= 40
        for item in out.scheduled:  # prefills are never split
            assert item.start == 0 or item.num_new_tokens == 1
    assert all(g.seqs[0].get_output_len() == 2 for g in groups)


# -- the step budget on its own (minipaged.sched.output) -------------------------------------


def test_step_budget_chunks_only_with_chunked_prefill() -> None:
    from minipaged.sampling.sequence import Sequence
    from minipaged.sched.output import StepBudget

    prompt = Sequence(0, list(range(10)))
    chunked, whole = StepBudget(tokens=4, seqs=2), StepBudget(4, 2, chunked_prefill=False)
    assert chunked.fits([prompt]) and chunked.chunk(10) == 4
    assert not whole.fits([prompt]) and whole.chunk(10) == 10
    chunked.take(4)
    assert chunked.exhausted and not chunked.fits([prompt])
    assert not StepBudget(tokens=8, seqs=1).fits([prompt, Sequence(1, [1])])
