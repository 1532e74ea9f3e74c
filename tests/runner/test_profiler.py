"""`minipaged.runner.profiler` on its own: profiling a runner whose costs are known.

A fake runner charges a fake clock exactly what a hidden `CostModel` says each batch costs (and
each swapped block); `profile_runner` must recover that model's coefficients from its
measurements. Every batch it builds must be one the real runner accepts: token ids inside the
vocabulary, block tables covering the positions, blocks on the device, no KV slot written twice
in a batch, within the requested sizes. `median_time` and `geometric_levels` are checked against
their definitions.
"""

from __future__ import annotations

import statistics
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minipaged.runner.profiler import geometric_levels, median_time, profile_runner
from minipaged.sched.cost_model import CostModel, StepShape
from minipaged.sched.output import ScheduledSequence, SchedulerOutput


class FakeRunner:
    """What `profile_runner` uses of a `ModelRunner`, checking every batch it is given."""

    def __init__(self, cost: CostModel, num_blocks: int, num_host: int, block_size: int) -> None:
        self.cost, self.now = cost, 0.0
        self.block_size = block_size
        self.kv_caches = [torch.empty(2, num_blocks, 1)]
        self.host_caches = [torch.empty(2, num_host, 1)] if num_host else []
        self.model_config = SimpleNamespace(vocab_size=37)
        self.batches: list[list[ScheduledSequence]] = []
        self.swaps: list[SchedulerOutput] = []

    def clock(self) -> float:
        return self.now

    def execute(self, plan: SchedulerOutput) -> None:
        entries = plan.scheduled
        bs, num_blocks = self.block_size, self.kv_caches[0].shape[1]
        written: set[tuple[int, int]] = set()
        for e in entries:
            assert e.token_ids and all(0 <= t < self.model_config.vocab_size for t in e.token_ids)
            end = e.start + len(e.token_ids)
            assert len(e.block_table) * bs >= end, "the block table does not cover the tokens"
            assert all(0 <= b < num_blocks for b in e.block_table)
            for pos in range(e.start, end):
                slot = (e.block_table[pos // bs], pos % bs)
                assert slot not in written, f"KV slot {slot} written twice in one batch"
                written.add(slot)
        self.batches.append(entries)
        self.now += self.cost.step_time(shape_of(entries))

    def apply_cache_ops(self, ops: SchedulerOutput) -> None:
        assert not ops.swap_in and not ops.copy
        self.swaps.append(ops)
        self.now += self.cost.swap_time(len(ops.swap_out))


def shape_of(entries: list[ScheduledSequence]) -> StepShape:
    """A batch's shape: prompts from position 0 are prefill; a decode reads start + 1 tokens."""
    decodes = [e for e in entries if e.start > 0]
    return StepShape(
        prefill_tokens=sum(len(e.token_ids) for e in entries if e.start == 0),
        decode_seqs=len(decodes),
        context_tokens=sum(e.start + 1 for e in decodes),
    )


coefficient = st.floats(1e-6, 1e-2)


@given(
    true=st.builds(CostModel, coefficient, coefficient, coefficient, coefficient,
                   per_swap_block=coefficient),
    max_prefill=st.integers(8, 64),
    max_batch=st.integers(2, 8),
    max_context=st.integers(40, 128),
    block_size=st.sampled_from([4, 8, 16]),
    num_blocks=st.integers(48, 80),
    num_host=st.integers(0, 40),
    repeats=st.integers(1, 3),
)
def test_profiling_recovers_the_runners_true_costs_with_valid_batches(
    true, max_prefill, max_batch, max_context, block_size, num_blocks, num_host, repeats
) -> None:
    runner = FakeRunner(true, num_blocks, num_host, block_size)
    fitted = profile_runner(
        runner, max_prefill=max_prefill, max_batch=max_batch, max_context=max_context,
        repeats=repeats, clock=runner.clock,
    )
    for name in ("base", "per_prefill_token", "per_decode_seq", "per_context_token"):
        assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=1e-6, abs=1e-12)
    if num_host:
        assert fitted.per_swap_block == pytest.approx(true.per_swap_block, rel=1e-9)
        n = min(num_host, num_blocks, 32)
        assert all(list(ops.swap_out) == [(i, i) for i in range(n)] for ops in runner.swaps)
    else:
        assert fitted.per_swap_block == 0.0 and not runner.swaps
    shapes = [shape_of(b) for b in runner.batches]
    assert max(s.prefill_tokens for s in shapes) <= max_prefill
    assert max(s.decode_seqs for s in shapes) <= max_batch
    assert all(e.start < max_context for b in runner.batches for e in b)
    assert len(runner.batches) % (repeats + 1) == 0  # each batch: a warm-up, then the repeats


@given(durations=st.lists(st.floats(0, 10), min_size=2, max_size=8))
def test_median_time_is_the_median_of_the_runs_after_the_warm_up(durations) -> None:
    clock = SimpleNamespace(now=0.0, calls=0)

    def run() -> None:
        clock.now += durations[clock.calls]
        clock.calls += 1

    got = median_time(run, len(durations) - 1, lambda: clock.now)
    assert clock.calls == len(durations)
    assert got == pytest.approx(statistics.median(durations[1:]), abs=1e-9)


@given(low=st.integers(-2, 40), high=st.integers(-2, 300))
def test_geometric_levels_double_from_low_and_end_at_high(low, high) -> None:
    levels = geometric_levels(low, high)
    top = max(high, 1)
    assert levels[-1] == top and levels == sorted(set(levels))
    start = max(1, low)
    below = [v for v in levels if v < top]
    assert below == [start * 2**k for k in range(len(below))]
    assert not below or below[-1] * 2 >= top  # no level is skipped before the top
