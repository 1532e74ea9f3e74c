"""The cost model: the fit recovers known step times, shapes are counted right, a saved model
reads back equal, profiling leaves the engine as it found it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_engine, tiny_llama_parts

from minipaged.engine import engine as engine_module
from minipaged.kv.manager import KVCacheManager
from minipaged.sampling.params import SamplingParams
from minipaged.sampling.sequence import Sequence, SequenceGroup
from minipaged.sched.base import SchedulerConfig
from minipaged.sched.cost_model import OPT_13B_A100, CostModel, StepShape, step_shape
from minipaged.sched.fcfs import FCFSScheduler
from minipaged.sim.profiling import measure_engine_steps, profile_engine

TRUE = CostModel(base=2e-3, per_prefill_token=5e-5, per_decode_seq=1e-4, per_context_token=2e-7)


def random_shapes(rng: np.random.Generator, n: int) -> list[StepShape]:
    shapes = []
    for _ in range(n):
        decode = int(rng.integers(0, 32))
        shapes.append(
            StepShape(
                prefill_tokens=int(rng.integers(0, 512)),
                decode_seqs=decode,
                context_tokens=decode * int(rng.integers(1, 600)),
            )
        )
    return [s for s in shapes if s.prefill_tokens or s.decode_seqs]


@given(seed=st.integers(0, 10**6))
@settings(max_examples=20)
def test_fit_recovers_the_coefficients_of_exact_times(seed):
    shapes = random_shapes(np.random.default_rng(seed), 40)
    fitted = CostModel.fit(shapes, [TRUE.step_time(s) for s in shapes])
    for name in ("base", "per_prefill_token", "per_decode_seq", "per_context_token"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=1e-6, abs=1e-12)


def test_fit_keeps_coefficients_non_negative():
    # Times that do not depend on the context, with noise that a free fit turns negative.
    rng = np.random.default_rng(0)
    shapes = random_shapes(rng, 60)
    no_context = CostModel(
        base=1e-3, per_prefill_token=1e-5, per_decode_seq=1e-4, per_context_token=0.0
    )
    times = [no_context.step_time(s) * (1 + 0.05 * rng.standard_normal()) for s in shapes]
    fitted = CostModel.fit(shapes, times)
    assert (
        min(fitted.base, fitted.per_prefill_token, fitted.per_decode_seq, fitted.per_context_token)
        >= 0
    )
    assert fitted.per_decode_seq == pytest.approx(1e-4, rel=0.2)


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="per_prefill_token"):
        CostModel(base=0.0, per_prefill_token=-1.0, per_decode_seq=0.0, per_context_token=0.0)
    with pytest.raises(ValueError, match="decode_seqs"):
        StepShape(decode_seqs=-1)
    with pytest.raises(ValueError, match="at least 4"):
        CostModel.fit([StepShape(1)], [1.0])
    with pytest.raises(ValueError, match="2 shapes but 1 times"):
        CostModel.fit([StepShape(1), StepShape(2)], [1.0])


def test_predictions():
    assert TRUE.step_time(StepShape()) == 0.0  # an empty step costs nothing
    assert TRUE.prefill_time(100) == pytest.approx(2e-3 + 100 * 5e-5)
    assert TRUE.step_time(StepShape(0, 3, 300)) == pytest.approx(2e-3 + 3e-4 + 300 * 2e-7)
    assert OPT_13B_A100.swap_time(10) == pytest.approx(10 * OPT_13B_A100.per_swap_block)


def test_the_shortest_iteration_is_one_token_of_one_sequence():
    assert TRUE.min_iteration_time == pytest.approx(2e-3 + 5e-5)  # a one-token prefill here
    # Here a decode (17.1505 ms) is a hair longer than a one-token prefill (17.15 ms).
    assert OPT_13B_A100.min_iteration_time == pytest.approx(17e-3 + 0.15e-3, rel=1e-9)
    for cost in (TRUE, OPT_13B_A100):
        shapes = random_shapes(np.random.default_rng(3), 200)
        assert min(cost.step_time(s) for s in shapes) >= cost.min_iteration_time


def test_shape_of_a_scheduled_step_counts_prefill_and_decode():
    kv = KVCacheManager(32, 4)
    scheduler = FCFSScheduler(SchedulerConfig(max_model_len=64), kv)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    first = SequenceGroup("a", [Sequence(0, list(range(3, 10)))], params, arrival_time=0.0)
    scheduler.add(first)
    out = scheduler.schedule(0.0)
    assert step_shape(out.scheduled) == StepShape(prefill_tokens=7)
    scheduler.mark_computed(out)
    first.seqs[0].append_token(5, 0.0)
    scheduler.finish_step()
    second = SequenceGroup("b", [Sequence(1, list(range(20, 25)))], params, arrival_time=0.0)
    scheduler.add(second)
    out = scheduler.schedule(1.0)
    # `first` decodes its 8th token (context 8); `second` prefills 5 tokens.
    assert step_shape(out.scheduled) == StepShape(
        prefill_tokens=5, decode_seqs=1, context_tokens=8
    )


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama_parts()


def test_profiling_an_engine_leaves_it_idle_with_its_own_scheduler(tiny):
    engine = tiny_engine(tiny, num_gpu_blocks=64, num_cpu_blocks=16, block_size=8)
    scheduler = engine.scheduler
    cost = profile_engine(engine, max_prefill=32, max_batch=4)
    assert engine.scheduler is scheduler
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks == 64
    assert cost.base >= 0 and cost.per_prefill_token >= 0 and cost.per_swap_block > 0
    # Not idle: refused.
    engine.add_request(None, [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="idle"):
        profile_engine(engine)


def test_profiling_an_engine_times_steps_like_serving_ones(tiny):
    """The calibration keeps 1, 2, 4 requests in flight, replacing each that finishes: its steps
    include the mixed ones (a new prompt beside decodes) a served trace is full of, and decode
    batches of every size up to the largest level."""
    engine = tiny_engine(tiny, num_gpu_blocks=64, num_cpu_blocks=16, block_size=8)
    shapes, times = measure_engine_steps(
        engine, max_prefill=32, max_batch=4, seed=0, clock=lambda: 0.0
    )
    assert len(shapes) == len(times) > 100
    mixed = [s for s in shapes if s.prefill_tokens and s.decode_seqs]
    assert len(mixed) >= 10
    assert {1, 2, 3, 4} <= {s.decode_seqs for s in shapes}
    assert all(s.prefill_tokens <= 4 * 32 for s in shapes)
    assert not engine.has_unfinished_requests()


def test_profiling_a_runner_fits_its_forward_passes(tiny):
    engine = tiny_engine(tiny, num_gpu_blocks=64, num_cpu_blocks=16, block_size=8, scheduler="mlfq")
    # The engine profiled its runner for skip-join at start-up.
    cost = engine.scheduler.cost_model
    assert isinstance(cost, CostModel) and cost.name == "profiled"
    assert cost.prefill_time(64) >= cost.prefill_time(1) > 0


def test_a_saved_cost_model_reads_back_equal_and_bad_files_are_named(tmp_path):
    path = tmp_path / "cost.json"
    for cost in (TRUE, OPT_13B_A100):
        cost.save(path)
        assert CostModel.load(path) == cost
    bad = {
        "unknown fields": '{"base": 1, "per_prefill_token": 0, "per_decode_seq": 0, '
        '"per_context_token": 0, "speed": 2}',
        "missing": '{"base": 1}',
        "wrong type": '{"base": "1", "per_prefill_token": 0, "per_decode_seq": 0, '
        '"per_context_token": 0}',
        "JSON object": "[1, 2]",
        "per_decode_seq": '{"base": 1, "per_prefill_token": 0, "per_decode_seq": -1, '
        '"per_context_token": 0}',
    }
    for message, text in bad.items():
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            CostModel.load(path)


def test_mlfq_profiles_once_into_its_cost_model_file(tiny, tmp_path, monkeypatch):
    calls = []

    def fake_profile(runner, **kwargs):
        calls.append(kwargs)
        return TRUE

    monkeypatch.setattr(engine_module, "profile_runner", fake_profile)
    path = tmp_path / "profile.json"
    config = dict(num_gpu_blocks=32, block_size=8, scheduler="mlfq", cost_model_file=path)
    first = tiny_engine(tiny, **config)
    assert first.scheduler.cost_model == TRUE and CostModel.load(path) == TRUE
    assert calls == [{"progress": True}]  # the start-up profile shows its progress
    second = tiny_engine(tiny, **config)
    assert second.scheduler.cost_model == TRUE and len(calls) == 1  # read, not measured again
