"""Profile a model runner: time its forward passes and block swaps, fit a `CostModel`.

Skip-join MLFQ needs predicted step times before it can place a job in a queue (FastServe §4.1),
so an engine serving with it profiles its runner at start-up, before the first request: synthetic
prefill, decode and mixed batches on the runner's own KV blocks (which this overwrites), timed
and fitted by `CostModel.fit`. `minipaged.sim.profiling` measures whole engine steps instead, for
the simulator; it reuses the swap measurement and the level helper here.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from minipaged.runner.model_runner import ModelRunner
from minipaged.sched.cost_model import CostModel, step_shape
from minipaged.sched.output import ScheduledSequence, SchedulerOutput


def profile_runner(
    runner: ModelRunner,
    *,
    max_prefill: int = 256,
    max_batch: int = 16,
    max_context: int = 256,
    repeats: int = 3,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
    progress: bool = False,
) -> CostModel:
    """Time synthetic batches of up to `max_prefill` prompt tokens, `max_batch` decodes and
    `max_context` tokens of context on `runner` (the median of `repeats` runs each), and one
    swap, and fit a cost model. `progress` shows a progress bar. The KV blocks are overwritten:
    call it before serving.

    The batches -- prefills, decodes and mixed ones -- use blocks 0, 1, 2, ..."""
    bs = runner.block_size
    num_blocks = runner.kv_caches[0].shape[1]
    # Every sequence reads the same blocks but writes its own last one (no slot written twice).
    max_batch = max(1, min(max_batch, num_blocks // 2))
    longest = min(max(max_prefill, max_context), (num_blocks - max_batch) * bs)
    shared = list(range(-(-longest // bs)))
    rng = random.Random(seed)
    vocab = runner.model_config.vocab_size

    def entry(seq_id: int, tokens: list[int], start: int, table: list[int]) -> ScheduledSequence:
        return ScheduledSequence(
            "profile", seq_id, start, tuple(tokens), is_prefill=start == 0, block_table=tuple(table)
        )

    def prefill(n: int) -> ScheduledSequence:
        return entry(-1, [rng.randrange(vocab) for _ in range(n)], 0, shared)

    def decodes(context: int, batch: int) -> list[ScheduledSequence]:
        own = -(-context // bs) - 1
        return [
            entry(i, [rng.randrange(vocab)], context - 1, shared[:own] + [len(shared) + i])
            for i in range(batch)
        ]

    sizes = geometric_levels(1, min(max_prefill, longest))
    batches = geometric_levels(1, max_batch)
    contexts = geometric_levels(16, min(max_context, longest))
    plans: list[list[ScheduledSequence]] = [[prefill(n)] for n in sizes]
    plans += [decodes(c, b) for b in batches for c in contexts]
    plans += [decodes(contexts[-1], batches[-1]) + [prefill(n)] for n in sizes[::2]]
    shapes, times = [], []
    for entries in tqdm(plans, desc="profiling the model", unit="batch", disable=not progress):
        plan = SchedulerOutput(scheduled=entries)
        times.append(median_time(lambda p=plan: runner.execute(p), repeats, clock))
        shapes.append(step_shape(entries))
    swap = measure_swap_time(runner, repeats, clock)
    return CostModel.fit(shapes, times, per_swap_block=swap, name="profiled")


def measure_swap_time(runner: ModelRunner, repeats: int, clock: Callable[[], float]) -> float:
    """Seconds per block of a device <-> host copy (0 when there is no host pool)."""
    num_host = runner.host_caches[0].shape[1] if runner.host_caches else 0
    n = min(num_host, runner.kv_caches[0].shape[1], 32)
    if n < 1:
        return 0.0
    ops = SchedulerOutput(swap_out=[(i, i) for i in range(n)])
    return median_time(lambda: runner.apply_cache_ops(ops), repeats, clock) / n


def median_time(run: Callable[[], Any], repeats: int, clock: Callable[[], float]) -> float:
    """The median time of `repeats` calls of `run`, after one untimed warm-up call (first calls
    allocate and build kernels)."""
    run()
    samples = []
    for _ in range(repeats):
        start = clock()
        run()
        samples.append(clock() - start)
    return statistics.median(samples)


def geometric_levels(low: int, high: int) -> list[int]:
    """low, 2 low, 4 low, ... up to and including high."""
    values = {max(high, 1)}
    value = max(1, low)
    while value < high:
        values.add(value)
        value *= 2
    return sorted(values)
