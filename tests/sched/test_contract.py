"""The contract every scheduler keeps (`minipaged.sched.base.Scheduler`), checked for every
entry of the registry (`minipaged.sched.registry.SCHEDULERS`) under both preemption modes.

Everything runs a real tiny engine (`tests/tiny_models.py`) on a deterministic clock; faults
come in through the engine's public `model` parameter. What every scheduler must do:

* keep the base class's signatures (the engine calls every scheduler alike);
* admit what it can serve and refuse at once, untouched, what it never could;
* abort a request wherever it is with the status it is given, returning its blocks;
* end the requests of a failing step with "error" while the others go on;
* preempt and re-admit a request without changing its tokens;
* drain: every request ends, every GPU and CPU block is free, the KV invariants hold,
  after every step of random request streams (a `hypothesis.stateful` machine).
"""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from tiny_models import run_bounded, tiny_llama_parts

from minipaged.engine.config import EngineConfig
from minipaged.engine.engine import LLMEngine
from minipaged.sampling.params import SamplingParams
from minipaged.sampling.sequence import SequenceStatus
from minipaged.sched.base import Scheduler
from minipaged.sched.cost_model import CostModel
from minipaged.sched.mlfq import MLFQ_VARIANTS
from minipaged.sched.output import (
    PreemptionMode,
    RequestRejectedError,
    SchedulerConfig,
    SchedulerOutput,
)
from minipaged.sched.registry import RESERVATIONS, SCHEDULERS, build_scheduler, needs_cost_model

VOCAB = 96
POISON = VOCAB - 1  # a prompt holding this token makes the model fail (FailingModel)
MAX_LEN = 64
MAX_STEPS = 600  # far more than any run here needs: reaching it means no progress
# Every scheduler under both preemption modes, but a variant that stands for one mode
# ("mlfq-recompute") only under that one: the other is refused (test_config.py).
CASES = [
    (name, mode)
    for name in sorted(SCHEDULERS)
    for mode in ("recompute", "swap")
    if name not in MLFQ_VARIANTS or MLFQ_VARIANTS[name].preemption_mode in (None, mode)
]
# Step costs for the MLFQ schedulers' skip-join (they would profile the model otherwise).
COST = CostModel(base=1e-3, per_prefill_token=2e-5, per_decode_seq=1e-4, per_context_token=0.0)


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama_parts(
        vocab_size=VOCAB, initializer_range=0.3, max_position_embeddings=MAX_LEN
    )


class FailingModel(torch.nn.Module):
    """The model, raising in every forward pass whose batch holds the token `POISON`."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, input_ids: torch.Tensor, *args):
        if bool((input_ids == POISON).any()):
            raise RuntimeError("injected fault in the forward pass")
        return self.model(input_ids, *args)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


def make_engine(tiny, name: str, mode: str, model=None, **overrides) -> LLMEngine:
    """A tiny engine under scheduler `name`, on a clock that ticks a millisecond per reading
    (MLFQ's quanta and starvation bound then act the same on every run)."""
    settings_ = dict(
        num_gpu_blocks=40, num_cpu_blocks=16, block_size=4, max_num_seqs=3,
        max_num_batched_tokens=32, max_model_len=MAX_LEN, scheduler=name, preemption_mode=mode,
    )
    if needs_cost_model(name):
        settings_["cost_model"] = COST
    settings_.update(overrides)
    ticks = itertools.count()
    base_model, model_config = tiny
    return LLMEngine(
        model or base_model, model_config, None, EngineConfig(**settings_),
        clock=lambda: next(ticks) * 1e-3,
    )


def assert_drained(engine: LLMEngine) -> None:
    kv = engine.kv_manager
    kv.check_invariants()
    assert not engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_gpu_blocks
    if kv.num_cpu_blocks:  # the reservation baselines have no CPU pool
        assert kv.num_free_cpu_blocks == kv.num_cpu_blocks


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


PROMPTS = [[2 + (7 * i + 3 * j) % 90 for j in range(4 + 5 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def expected(tiny):
    """Greedy tokens of PROMPTS, each alone in a large cache."""
    out = []
    for prompt in PROMPTS:
        engine = make_engine(tiny, "fcfs", "recompute", num_gpu_blocks=64)
        engine.add_request("r", prompt, greedy(12))
        out.append(run_bounded(engine)["r"].outputs[0].token_ids)
    return out


# -- one interface --------------------------------------------------------------------------------


def test_the_base_is_abstract():
    with pytest.raises(TypeError, match="abstract"):
        Scheduler(SchedulerConfig(), None)  # type: ignore[abstract]


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_every_scheduler_keeps_the_base_signatures(name):
    scheduler = build_scheduler(
        name, SchedulerConfig(max_model_len=MAX_LEN), num_gpu_blocks=32, block_size=4
    )
    assert isinstance(scheduler, Scheduler)
    for attr, base in vars(Scheduler).items():
        if attr.startswith("_") or not inspect.isfunction(base):
            continue
        ours, theirs = inspect.signature(getattr(type(scheduler), attr)), inspect.signature(base)
        assert list(ours.parameters.values()) == list(theirs.parameters.values()), (
            f"{type(scheduler).__name__}.{attr}{ours} narrows Scheduler.{attr}{theirs}"
        )


# -- admission ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, mode", CASES)
def test_admission_serves_what_fits_and_refuses_the_rest_untouched(tiny, name, mode, expected):
    engine = make_engine(tiny, name, mode, num_gpu_blocks=20)
    small = make_engine(tiny, name, mode, num_gpu_blocks=16)  # 64 tokens
    refusals = [
        (engine, [3] * MAX_LEN, greedy(1), "context"),  # no room to generate
        (engine, [3] * 4, SamplingParams(n=4, temperature=1.0, max_tokens=2), "max_num_seqs"),
        (small, [3] * 10, SamplingParams(n=2, max_tokens=40), "KV blocks"),  # > the cache
    ]
    for where, prompt, params, message in refusals:
        with pytest.raises(RequestRejectedError, match=message):
            where.add_request(None, prompt, params)
        assert not where.has_unfinished_requests()
        assert where.kv_manager.num_free_blocks == where.kv_manager.num_gpu_blocks
    ids = [engine.add_request(None, prompt, greedy(12)) for prompt in PROMPTS[:3]]
    finals = run_bounded(engine)
    assert [finals[i].outputs[0].token_ids for i in ids] == expected[:3]
    assert_drained(engine)


# -- abort ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, mode", CASES)
def test_abort_ends_a_request_anywhere_with_its_status_and_returns_its_blocks(tiny, name, mode):
    engine = make_engine(tiny, name, mode, num_gpu_blocks=16, max_num_batched_tokens=16)
    scheduler = engine.scheduler
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, greedy(12))
    swaps = mode == "swap" and name not in RESERVATIONS  # the baselines have no CPU pool
    wanted = ["waiting", "running"] + ["swapped"] * swaps
    for _ in range(40):  # until a request sits in every queue it can
        engine.step()
        if all(getattr(scheduler, queue) for queue in wanted):
            break
    queues = {
        group.request_id: (queue, group.get_unfinished_seqs())
        for queue in ("waiting", "running", "swapped")
        for group in getattr(scheduler, queue)
    }
    assert set(wanted) <= {queue for queue, _ in queues.values()}
    status = SequenceStatus.FINISHED_ERROR
    for request_id, (_, alive) in queues.items():
        group = scheduler.abort(request_id, status)
        assert group is not None and group.request_id == request_id
        assert alive and all(s.status is status for s in alive)
        assert scheduler.abort(request_id, status) is None  # gone
    assert scheduler.abort("nobody") is None
    assert not scheduler.has_unfinished()
    kv = engine.kv_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_gpu_blocks
    if kv.num_cpu_blocks:
        assert kv.num_free_cpu_blocks == kv.num_cpu_blocks


# -- a failing step -------------------------------------------------------------------------------


@pytest.mark.parametrize("name, mode", CASES)
def test_a_failing_step_ends_its_requests_with_error_and_the_others_go_on(tiny, name, mode):
    engine = make_engine(tiny, name, mode, model=FailingModel(tiny[0]), max_num_seqs=2)
    bad = engine.add_request("bad", [5, 6, POISON, 7], greedy(6))
    good = [engine.add_request(f"r{i}", prompt, greedy(6)) for i, prompt in enumerate(PROMPTS)]
    finals = run_bounded(engine)
    assert sorted(finals) == sorted([bad, *good])  # every request ended
    reasons = {k: {c.finish_reason for c in v.outputs} for k, v in finals.items()}
    assert reasons[bad] == {"error"}
    assert all(r <= {"error", "length"} for r in reasons.values())
    assert any(r == {"length"} for r in reasons.values())  # the others went on
    assert_drained(engine)


# -- preemption and re-admission ------------------------------------------------------------------


@pytest.mark.parametrize("name, mode", CASES)
def test_preempted_requests_come_back_with_the_same_tokens(tiny, name, mode, expected):
    """A cache too small for everyone preempts (the reservation baselines never outgrow a
    reservation, so they only queue), and a preemption by the scheduler's own `preempt`
    between steps is re-admitted too; greedy tokens are those of each request alone."""
    engine = make_engine(tiny, name, mode, num_gpu_blocks=16 if name in RESERVATIONS else 14)
    ids = [engine.add_request(f"r{i}", prompt, greedy(12)) for i, prompt in enumerate(PROMPTS)]
    finals, preempted_by_hand = {}, 0
    for step in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        if step % 5 == 2 and engine.scheduler.running:
            group = engine.scheduler.running[-1]
            engine.scheduler.preempt(group, SchedulerOutput(), PreemptionMode.RECOMPUTE)
            preempted_by_hand += 1
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        engine.kv_manager.check_invariants()
    assert preempted_by_hand
    if name not in RESERVATIONS:
        assert engine.scheduler.num_preemptions > preempted_by_hand  # the cache preempted too
    assert [finals[i].outputs[0].token_ids for i in ids] == expected
    assert_drained(engine)


# -- random request streams -----------------------------------------------------------------------


class RequestStreams(RuleBasedStateMachine):
    """Random arrivals (plain, parallel samples, beams), aborts and steps on a small cache;
    the KV invariants after every rule, every request ended at the end, every block free."""

    def __init__(self, tiny, name: str, mode: str) -> None:
        super().__init__()
        self.tiny, self.name, self.mode = tiny, name, mode

    @initialize(blocks=st.integers(16, 30), chunked=st.booleans())
    def start(self, blocks, chunked):
        self.engine = make_engine(
            self.tiny, self.name, self.mode, num_gpu_blocks=blocks, num_cpu_blocks=8,
            max_num_batched_tokens=32 if chunked else MAX_LEN, enable_chunked_prefill=chunked,
        )
        self.live: set[str] = set()
        self.ended: dict[str, set[str | None]] = {}
        self.count = itertools.count()

    @rule(
        prompt_len=st.integers(1, 24),
        max_tokens=st.integers(1, 8),
        kind=st.sampled_from(["greedy", "sample", "n", "beam"]),
    )
    def add(self, prompt_len, max_tokens, kind):
        request_id = f"q{next(self.count)}"
        prompt = [2 + (len(self.ended) + 5 * i) % 90 for i in range(prompt_len)]
        params = {
            "greedy": greedy(max_tokens),
            "sample": SamplingParams(temperature=1.0, seed=1, max_tokens=max_tokens),
            "n": SamplingParams(n=2, temperature=1.0, seed=2, max_tokens=max_tokens),
            "beam": SamplingParams(
                use_beam_search=True, beam_width=2, temperature=0.0, max_tokens=max_tokens
            ),
        }[kind]
        try:
            self.engine.add_request(request_id, prompt, params)
        except RequestRejectedError:
            return
        self.live.add(request_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        assert self.engine.abort_request(request_id)
        self.live.discard(request_id)
        self.ended[request_id] = {"abort"}

    @rule()
    def step(self):
        for output in self.engine.step():
            if output.finished:
                assert output.request_id in self.live
                self.live.discard(output.request_id)
                self.ended[output.request_id] = {c.finish_reason for c in output.outputs}

    @invariant()
    def kv_consistent(self):
        self.engine.kv_manager.check_invariants()
        assert self.engine.get_num_unfinished_requests() == len(self.live)

    def teardown(self):
        for _ in range(MAX_STEPS):
            if not self.engine.has_unfinished_requests():
                break
            self.step()
            self.kv_consistent()
        assert not self.live, f"{sorted(self.live)} never ended"
        assert all(r <= {"length", "stop", "abort"} for r in self.ended.values()), self.ended
        assert_drained(self.engine)


@pytest.mark.parametrize("name, mode", CASES)
def test_random_request_streams_end_every_request_and_free_every_block(tiny, name, mode):
    run_state_machine_as_test(
        lambda: RequestStreams(tiny, name, mode),
        settings=settings(max_examples=5, stateful_step_count=25, deadline=None),
    )
