"""The base scheduler's mechanics under FCFS: hand-built traces with made-up tokens, and, through
the engine, admission (refusing only what no schedule can serve) and the long-prefill threshold."""

from __future__ import annotations

import pytest
from fake_sampling import assert_queues_follow_status, sample_made_up_tokens
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_llama_parts

from minipaged.engine.config import EngineConfig
from minipaged.engine.engine import LLMEngine
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
        table = scheduler.kv_manager.block_table(item.seq_id)
        assert item.block_table == tuple(table)  # the step's tables ride on its output
        assert len(table) * BLOCK >= item.start + item.num_new_tokens
    scheduler.mark_computed(out)
    sample_made_up_tokens(scheduler, out)
    scheduler.finish_step()
    assert_queues_follow_status(scheduler)
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
    assert [g for g, _ in scheduler.resolve(out.scheduled)] == [first]


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
    assert out.preempted == [late.request_id]
    assert [s.request_id for s in out.scheduled] == [early.request_id]
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
        # `newcomer` may not overtake `late`
        assert newcomer.request_id not in {s.request_id for s in out.scheduled}
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
            assert item.block_table == tuple(scheduler.kv_manager.block_table(item.seq_id))
            assert len(item.block_table) * BLOCK >= item.start + item.num_new_tokens
        swapped_in_steps += bool(out.swap_in)
        scheduler.mark_computed(out)
        sample_made_up_tokens(scheduler, out)
        scheduler.finish_step()
    assert swapped_in_steps >= 1


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

    scheduler = make_scheduler()
    prompt = Sequence(0, list(range(10)))
    chunked, whole = StepBudget(tokens=4, seqs=2), StepBudget(4, 2, chunked_prefill=False)
    assert scheduler.fits_budget([prompt], chunked)
    assert scheduler.step_plan([prompt], chunked) == [(prompt, 4)]
    assert not scheduler.fits_budget([prompt], whole)
    assert scheduler.step_plan([prompt], StepBudget(10, 2, chunked_prefill=False)) == [(prompt, 10)]
    chunked.take(4)
    assert chunked.exhausted and not scheduler.fits_budget([prompt], chunked)
    assert not scheduler.fits_budget([prompt, Sequence(1, [1])], StepBudget(tokens=8, seqs=1))


# -- admission refuses only what no schedule can serve (through the engine) -----------------------

ENGINE_MAX_LEN = 64


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama_parts(vocab_size=96, initializer_range=0.3, max_position_embeddings=64)


class UncheckedFCFS(FCFSScheduler):
    """FCFS admitting everything: the brute force that says whether a schedule exists."""

    def check_request(self, group: SequenceGroup) -> None:
        return None


def drive(engine: LLMEngine, max_steps: int, budget: int | None = None) -> dict:
    """Step until done (or `max_steps`); the finished outputs by request id. Every step stays
    within `budget` tokens and keeps the KV invariants."""
    finals = {}
    records = []
    engine.add_step_observer(records.append)
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        engine.kv_manager.check_invariants()
        if budget is not None and records:
            assert sum(s.num_new_tokens for s in records[-1].scheduled) <= budget
    return finals


def params_of(kind: str, max_tokens: int, width: int) -> SamplingParams:
    if kind == "beam":
        return SamplingParams(
            use_beam_search=True, beam_width=width, temperature=0.0, max_tokens=max_tokens,
            ignore_eos=True,  # the longest run: the one admission must make room for
        )
    return SamplingParams(n=width, temperature=1.0, seed=3, max_tokens=max_tokens, ignore_eos=True)


def test_a_group_whose_prompt_fits_the_budget_is_admitted_without_chunked_prefill(tiny):
    """n=3, a 30-token prompt, 64 tokens a step: once refused ("n=3 needs 159 of
    max_num_batched_tokens=64"); recomputed after preemption, its samples come back in
    pieces of the budget sharing the prompt, and it finishes."""
    model, config = tiny
    for kind in ("n", "beam"):
        engine = LLMEngine(model, config, None, EngineConfig(
            num_gpu_blocks=34, block_size=4, max_num_seqs=5, max_num_batched_tokens=64,
            max_model_len=64, enable_chunked_prefill=False, preemption_mode="recompute",
        ))
        for i in range(2):  # company that makes the cache preempt the group
            engine.add_request(f"r{i}", list(range(40, 60)), params_of("n", 40, 1))
        engine.add_request("group", list(range(2, 32)), params_of(kind, 30, 3))
        finals = drive(engine, 2000, budget=64)
        assert engine.scheduler.num_preemptions > 0
        assert len(finals["group"].outputs) == (3 if kind == "n" else 1)  # beams: the best
        assert {c.finish_reason for c in finals["group"].outputs} <= {"length", "stop"}
        assert not engine.has_unfinished_requests()
        assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_gpu_blocks


@given(
    chunked=st.booleans(),
    block_size=st.sampled_from([1, 4, 8]),
    num_gpu_blocks=st.integers(4, 48),
    max_num_seqs=st.integers(1, 4),
    extra_budget=st.integers(0, 40),
    mode=st.sampled_from([None, "swap", "recompute"]),
    host=st.sampled_from([0, 8]),
    requests=st.lists(
        st.tuples(
            st.integers(1, 40), st.integers(1, 24), st.integers(1, 4),
            st.sampled_from(["n", "beam"]),
        ),
        min_size=1, max_size=5,
    ),
)
@settings(max_examples=25, deadline=None)
def test_admission_refuses_only_what_no_schedule_can_serve(
    tiny, chunked, block_size, num_gpu_blocks, max_num_seqs, extra_budget, mode, host, requests
):
    model, config = tiny
    budget = (8 if chunked else ENGINE_MAX_LEN) + extra_budget
    settings_ = dict(
        block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
        max_model_len=ENGINE_MAX_LEN, enable_chunked_prefill=chunked, preemption_mode=mode,
    )
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=ENGINE_MAX_LEN,
        enable_chunked_prefill=chunked, preemption_mode=mode,
    )

    def engine_with(scheduler=None):
        return LLMEngine(model, config, None, EngineConfig(
            num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=host, **settings_
        ), scheduler=scheduler)

    engine = engine_with()
    admitted = []
    for i, (prompt_len, max_tokens, width, kind) in enumerate(requests):
        prompt = [2 + (i + 3 * j) % 90 for j in range(min(prompt_len, ENGINE_MAX_LEN - 1))]
        params = params_of(kind, max_tokens, width)
        try:
            engine.add_request(f"r{i}", prompt, params)
            admitted.append(f"r{i}")
        except RequestRejectedError:
            # The brute force: alone, admitted unchecked, it never finishes.
            kv = KVCacheManager(num_gpu_blocks, block_size, num_cpu_blocks=host)
            alone = engine_with(UncheckedFCFS(scheduler_config, kv))
            alone.add_request("alone", prompt, params)
            try:
                finals = drive(alone, 300)
            except Exception:  # the manager or the runner gave up: no schedule served it
                finals = {}
            served = "alone" in finals and "error" not in {
                c.finish_reason for c in finals["alone"].outputs
            }
            # Beams share the blocks of their common past, which depends on the tokens: their
            # refusal counts the worst case (beams apart from the first token), not this run.
            if kind == "n":
                assert not served, f"refused {prompt_len=} {max_tokens=} {width=} alone runs"
    finals = drive(engine, 3000, budget=budget)
    assert sorted(finals) == sorted(admitted)
    for request_id in admitted:
        assert {c.finish_reason for c in finals[request_id].outputs} <= {"length", "stop"}
    assert engine.kv_manager.num_free_blocks == num_gpu_blocks


# -- a long prompt does not hold up the others (long_prefill_token_threshold) ---------------------


def test_a_long_prefill_leaves_room_for_a_short_request(tiny):
    model, config = tiny

    def first_token_steps(threshold: int) -> tuple[int, dict]:
        engine = LLMEngine(model, config, None, EngineConfig(
            num_gpu_blocks=64, block_size=4, max_num_batched_tokens=16, max_model_len=64,
            long_prefill_token_threshold=threshold,
        ))
        engine.add_request("long", [2 + j % 90 for j in range(60)], params_of("n", 3, 1))
        engine.step()  # the long prompt's first chunk
        engine.add_request("short", [5, 6, 7], params_of("n", 3, 1))
        steps, first = 0, None
        finals = {}
        while engine.has_unfinished_requests():
            steps += 1
            for output in engine.step():
                if output.request_id == "short" and first is None:
                    first = steps
                if output.finished:
                    finals[output.request_id] = output.outputs[0].token_ids
        return first, finals

    without, plain = first_token_steps(0)
    bounded, capped = first_token_steps(12)
    assert without >= 3  # waits for the whole 60-token prefill, 16 tokens a step
    assert bounded == 1  # 12 tokens for the long prompt, room for the short one at once
    assert capped == plain  # the same tokens
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=8, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        EngineConfig(long_prefill_token_threshold=-1)
