"""How long one engine step takes: a linear cost model fitted to measured steps.

The simulator (`minipaged.simulate`) replaces the model with this, and skip-join MLFQ
(`minipaged.mlfq`, FastServe §4.1) uses it to predict a new job's prefill time, the "first
iteration time" that decides which queue it joins. One step's time is modelled as

    base + per_prefill_token * prefill tokens + per_decode_seq * decoding sequences
         + per_context_token * context tokens the decodes read

(an intercept for the fixed cost of a forward pass -- on a GPU, reading the weights once --,
the prefill's tokens, the decodes' tokens, and the KV cache the decodes attend to), plus
`per_swap_block` seconds for each block copied between device and host memory.

`CostModel.profile(engine_or_runner)` measures steps on this machine and fits the four numbers
by least squares; the presets give the papers' set-up (OPT-13B on one A100) from public
numbers, for simulations bigger than this machine.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from minipaged.engine import LLMEngine
    from minipaged.runner import ModelRunner
    from minipaged.scheduler import SchedulerOutput

# -- data types -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepShape:
    """What a step computes, in the terms the cost model charges for."""

    prefill_tokens: int = 0  # tokens of prompt (or recomputation) chunks
    decode_seqs: int = 0  # sequences computing one new token
    context_tokens: int = 0  # KV entries the decoding sequences attend to, summed

    def __post_init__(self) -> None:
        for name in ("prefill_tokens", "decode_seqs", "context_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepShape:
        """The shape of a scheduled step."""
        prefill = decode = context = 0
        for item in out.scheduled:
            if item.is_prefill:
                prefill += item.num_new_tokens
            else:
                decode += 1
                context += item.start + item.num_new_tokens
        return cls(prefill, decode, context)

    @property
    def features(self) -> tuple[float, float, float, float]:
        """The regressors of the linear model: intercept, prefill, decode, context."""
        return (
            1.0,
            float(self.prefill_tokens),
            float(self.decode_seqs),
            float(self.context_tokens),
        )


@dataclass(frozen=True)
class CostModel:
    """Seconds per step as a linear function of its shape, plus seconds per swapped block."""

    base: float  # seconds of any non-empty step
    per_prefill_token: float
    per_decode_seq: float
    per_context_token: float
    per_swap_block: float = 0.0  # one block copied device -> host or host -> device
    name: str = "custom"

    def __post_init__(self) -> None:
        for name in ("base", "per_prefill_token", "per_decode_seq", "per_context_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")
        if self.per_swap_block < 0:
            raise ValueError(f"per_swap_block must be >= 0 seconds, got {self.per_swap_block}")

    # -- predictions ------------------------------------------------------------------------------

    def step_time(self, shape: StepShape) -> float:
        """Compute time of one step (no swaps); an empty step costs nothing."""
        if shape.prefill_tokens == 0 and shape.decode_seqs == 0:
            return 0.0
        coefficients = (self.base, self.per_prefill_token, self.per_decode_seq)
        return float(np.dot((*coefficients, self.per_context_token), shape.features))

    def prefill_time(self, prompt_len: int) -> float:
        """A job's first iteration alone: FastServe's skip-join key (§4.1)."""
        return self.step_time(StepShape(prefill_tokens=prompt_len))

    @property
    def min_iteration_time(self) -> float:
        """The shortest possible step: one token of one sequence (a decode over a context of
        one, or a one-token prefill). FastServe sizes its highest queue's quantum to it (§4.1)."""
        decode = self.step_time(StepShape(decode_seqs=1, context_tokens=1))
        return min(decode, self.step_time(StepShape(prefill_tokens=1)))

    def swap_time(self, num_blocks: int) -> float:
        return self.per_swap_block * num_blocks

    def scaled(self, factor: float) -> CostModel:
        """Every time multiplied by `factor` (a faster or slower machine)."""
        if factor <= 0:
            raise ValueError(f"factor must be > 0, got {factor}")
        return replace(
            self,
            base=self.base * factor,
            per_prefill_token=self.per_prefill_token * factor,
            per_decode_seq=self.per_decode_seq * factor,
            per_context_token=self.per_context_token * factor,
            per_swap_block=self.per_swap_block * factor,
        )

    # -- fitting ----------------------------------------------------------------------------------

    @classmethod
    def fit(
        cls,
        shapes: Sequence[StepShape],
        times: Sequence[float],
        per_swap_block: float = 0.0,
        name: str = "fitted",
    ) -> CostModel:
        """Least-squares fit of measured step times, every coefficient kept >= 0.

        A coefficient the data would make negative (noise, or a term the machine does not pay
        for) is set to 0 and the others refitted -- a tiny active-set non-negative least squares.
        """
        if len(shapes) != len(times):
            raise ValueError(f"{len(shapes)} shapes but {len(times)} times")
        if len(shapes) < 4:
            raise ValueError(f"need at least 4 measured steps to fit 4 numbers, got {len(shapes)}")
        x = np.array([s.features for s in shapes])
        y = np.array(times, dtype=float)
        active = [i for i in range(4) if x[:, i].any()]
        while True:
            coef = np.zeros(4)
            coef[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
            negative = [i for i in active if coef[i] < 0]
            if not negative:
                break
            active.remove(min(negative, key=lambda i: coef[i]))
        return cls(*(float(c) for c in coef), per_swap_block=per_swap_block, name=name)

    @classmethod
    def profile(
        cls,
        target: LLMEngine | ModelRunner,
        *,
        max_prefill: int = 256,
        max_batch: int = 16,
        max_context: int = 256,
        repeats: int = 3,
        seed: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> CostModel:
        """Measure steps on this machine and fit a cost model.

        Given an `LLMEngine`, whole `engine.step()` calls are timed on a calibration workload
        (scheduling and sampling included: what the simulator must reproduce); the engine must
        be idle and is left idle. Given a `ModelRunner`, its forward passes are timed on
        synthetic batches -- this overwrites KV blocks, so call it before serving. `clock` reads
        the time (`time.thread_time` measures this thread's CPU time only: steadier on a shared
        machine, with torch on one thread).
        """
        from minipaged.engine import LLMEngine

        if isinstance(target, LLMEngine):
            if target.has_unfinished_requests():
                raise ValueError("profile an idle engine: it still has unfinished requests")
            shapes, times = _measure_engine(target, max_prefill, max_batch, seed, clock)
            runner = target.runner
        else:
            runner = target
            shapes, times = _measure_runner(
                runner, max_prefill, max_batch, max_context, seed, repeats, clock
            )
        swap = _measure_swap(runner, repeats, clock)
        return cls.fit(shapes, times, per_swap_block=swap, name="profiled")


# The papers' set-up: OPT-13B in float16 on one A100-40GB (vLLM paper §6, FastServe §6), from
# public figures rather than a measurement: a decode step reads the 26 GB of weights once
# (~1.5 TB/s: ~17 ms); a prefill token costs ~26 GFLOP (~0.15 ms at ~170 TFLOP/s); a token's KV
# is 40 layers x 5120 x 2 x 2 bytes = 800 kB (~0.5 us to read); a 16-token block (12.8 MB)
# crosses PCIe 4.0 in ~0.5 ms. About 12 GB remain for the KV cache: ~930 blocks of 16 tokens.
OPT_13B_A100 = CostModel(
    base=17e-3,
    per_prefill_token=0.15e-3,
    per_decode_seq=0.15e-3,
    per_context_token=0.5e-6,
    per_swap_block=0.5e-3,
    name="OPT-13B on one A100 (public figures)",
)
OPT_13B_A100_KV_BLOCKS = 930  # of 16 tokens

PRESETS: dict[str, CostModel] = {"opt-13b-a100": OPT_13B_A100}


# -- measuring ----------------------------------------------------------------------------------


def _median_time(run: Callable[[], Any], repeats: int, clock: Callable[[], float]) -> float:
    run()  # warm-up: first calls allocate and build kernels
    samples = []
    for _ in range(repeats):
        start = clock()
        run()
        samples.append(clock() - start)
    return statistics.median(samples)


def _measure_runner(
    runner: ModelRunner,
    max_prefill: int,
    max_batch: int,
    max_context: int,
    seed: int,
    repeats: int,
    clock: Callable[[], float],
) -> tuple[list[StepShape], list[float]]:
    """Time synthetic prefill, decode and mixed batches on blocks 0, 1, 2, ..."""
    from minipaged.runner import BatchEntry

    bs = runner.block_size
    num_blocks = runner.kv_caches[0].shape[1]
    # Every sequence reads the same blocks but writes its own last one (no slot written twice).
    max_batch = max(1, min(max_batch, num_blocks // 2))
    longest = min(max(max_prefill, max_context), (num_blocks - max_batch) * bs)
    shared = list(range(-(-longest // bs)))
    rng = random.Random(seed)
    vocab = runner.config.vocab_size

    def prefill(n: int) -> BatchEntry:
        return BatchEntry([rng.randrange(vocab) for _ in range(n)], 0, shared)

    def decodes(context: int, batch: int) -> list[BatchEntry]:
        own = -(-context // bs) - 1
        return [
            BatchEntry([rng.randrange(vocab)], context - 1, shared[:own] + [len(shared) + i])
            for i in range(batch)
        ]

    sizes = _geometric(1, min(max_prefill, longest))
    batches = _geometric(1, max_batch)
    contexts = _geometric(16, min(max_context, longest))
    plans: list[list[BatchEntry]] = [[prefill(n)] for n in sizes]
    plans += [decodes(c, b) for b in batches for c in contexts]
    plans += [decodes(contexts[-1], batches[-1]) + [prefill(n)] for n in sizes[::2]]
    shapes, times = [], []
    for entries in plans:
        times.append(_median_time(lambda e=entries: runner.execute(e), repeats, clock))
        prefill_tokens = sum(len(e.token_ids) for e in entries if e.start_position == 0)
        decodes = [e for e in entries if e.start_position > 0]
        context = sum(e.start_position + 1 for e in decodes)
        shapes.append(StepShape(prefill_tokens, len(decodes), context))
    return shapes, times


CALIBRATION_STEPS_PER_LEVEL = 48  # engine steps timed at each concurrency level


def _measure_engine(
    engine: LLMEngine, max_prefill: int, max_batch: int, seed: int, clock: Callable[[], float]
) -> tuple[list[StepShape], list[float]]:
    """Time `engine.step()` while the engine serves 1, 2, 4, ... `max_batch` requests at once.

    At each level a finished request is replaced at once (random prompt and output lengths), so
    steps mix new prompts with decodes as they do in serving. (Waves of requests that start
    together never mix them; a fit from those alone over-predicted a replayed trace's steps by
    about 10%.)
    """
    from minipaged.sampling import SamplingParams

    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    recorder = _RecordingScheduler(engine.scheduler)
    engine.scheduler = recorder  # type: ignore[assignment]
    shapes: list[StepShape] = []
    times: list[float] = []

    def add_request() -> None:
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, max_prefill))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(4, 24), ignore_eos=True)
        engine.add_request(None, prompt, params)

    def timed_step() -> None:
        start = clock()
        engine.step()
        elapsed = clock() - start
        shape = StepShape.of(recorder.last)
        if shape.prefill_tokens or shape.decode_seqs:
            shapes.append(shape)
            times.append(elapsed)

    try:
        for concurrency in _geometric(1, max_batch):
            for _ in range(CALIBRATION_STEPS_PER_LEVEL):
                while engine.get_num_unfinished_requests() < concurrency:
                    add_request()
                timed_step()
        while engine.has_unfinished_requests():
            timed_step()
    finally:
        engine.scheduler = recorder.inner
    return shapes[1:], times[1:]  # the very first step warms up


def _measure_swap(runner: ModelRunner, repeats: int, clock: Callable[[], float]) -> float:
    """Seconds per block of a device <-> host copy (0 when there is no host pool)."""
    from minipaged.runner import CacheOps

    num_host = runner.host_caches[0].shape[1] if runner.host_caches else 0
    n = min(num_host, runner.kv_caches[0].shape[1], 32)
    if n < 1:
        return 0.0
    ops = CacheOps(swap_out=[(i, i) for i in range(n)])
    return _median_time(lambda: runner.apply_cache_ops(ops), repeats, clock) / n


def _geometric(low: int, high: int) -> list[int]:
    """low, 2 low, 4 low, ... up to and including high."""
    values = []
    value = max(1, low)
    while value < high:
        values.append(value)
        value *= 2
    values.append(max(high, 1))
    return sorted(set(values))


class _RecordingScheduler:
    """Wraps an engine's scheduler to keep the last `SchedulerOutput` (for profiling)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.last: SchedulerOutput | None = None

    def schedule(self, now: float) -> SchedulerOutput:
        self.last = self.inner.schedule(now)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
