"""Measure the real engine: fit a cost model to its steps, and replay a trace on it.

Both drive an `LLMEngine` through its public surface only -- `add_request`, `step`, and a step
observer for what each step computed -- and leave it idle, with its own scheduler.

* `profile_engine` times whole `engine.step()` calls (scheduling and sampling included: what
  the simulator must reproduce) while the engine serves 1, 2, 4, ... requests at once, and fits
  a `CostModel`. (`minipaged.runner.profiler` times forward passes alone, for MLFQ's start-up.)
* `replay_on_engine` serves a trace as `minipaged.sim.simulator.simulate` would, and measures what
  the simulator predicts, as a `SimulationResult`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection

from minipaged.engine.engine import LLMEngine
from minipaged.engine.record import StepRecord
from minipaged.runner.profiler import geometric_levels, measure_swap_time
from minipaged.sampling.params import SamplingParams
from minipaged.sched.cost_model import CostModel, StepShape
from minipaged.sim.simulator import RequestResult, SimulationResult, StepTally
from minipaged.sim.traces import TraceRequest

CALIBRATION_STEPS_PER_LEVEL = 48  # engine steps timed at each concurrency level


def profile_engine(
    engine: LLMEngine,
    *,
    max_prefill: int = 256,
    max_batch: int = 16,
    repeats: int = 3,
    seed: int = 0,
) -> CostModel:
    """Time `engine.step()` under a serving-like load (`measure_engine_steps`) and one block
    swap (the median of `repeats`), and fit a cost model, in the engine's own clock
    (`LLMEngine(clock=time.thread_time)` measures this thread's CPU time only: steadier on a
    shared machine, with torch on one thread). The engine must be idle; it is left idle."""
    clock = engine.clock
    shapes, times = measure_engine_steps(engine, max_prefill, max_batch, seed, clock)
    swap = measure_swap_time(engine.runner, repeats, clock)
    return CostModel.fit(shapes, times, per_swap_block=swap, name="profiled")


def measure_engine_steps(
    engine: LLMEngine, max_prefill: int, max_batch: int, seed: int, clock: Callable[[], float]
) -> tuple[list[StepShape], list[float]]:
    """Time `engine.step()` while the engine serves 1, 2, 4, ... `max_batch` requests at once.

    At each level a finished request is replaced at once (random prompts of up to
    `max_prefill` tokens, random output lengths), so steps mix new prompts with decodes as they
    do in serving; waves of requests that start together would never mix them. The very first
    step (a warm-up) is left out.
    """
    if engine.has_unfinished_requests():
        raise ValueError("profile an idle engine: it still has unfinished requests")
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    records: list[StepRecord] = []
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
        shape = records[-1].shape
        if shape.prefill_tokens or shape.decode_seqs:
            shapes.append(shape)
            times.append(elapsed)

    engine.add_step_observer(records.append)
    try:
        for concurrency in geometric_levels(1, max_batch):
            for _ in range(CALIBRATION_STEPS_PER_LEVEL):
                while engine.get_num_unfinished_requests() < concurrency:
                    add_request()
                timed_step()
        while engine.has_unfinished_requests():
            timed_step()
    finally:
        engine.remove_step_observer(records.append)
    return shapes[1:], times[1:]


def replay_on_engine(
    engine: LLMEngine, trace: Collection[TraceRequest], seed: int = 0
) -> SimulationResult:
    """Serve `trace` on a real engine (random prompt tokens, fixed output lengths) and measure
    what `simulate` predicts, for comparison; its `steps` are the engine's step records.

    Times are read from the engine's own clock (`LLMEngine(clock=...)`), the one its scheduler
    charges steps by: wall time by default; `time.thread_time` counts only this thread's CPU
    time, which keeps other processes on a shared machine out of the measurement (run torch on
    one thread then). While nothing is in flight the replay jumps to the next arrival instead
    of sleeping, as the simulator does; a request arrives on the engine's clock at its trace
    time, shifted by the time jumped over.
    """
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    pending = sorted(enumerate(trace), key=lambda x: x[1].arrival_time)
    pending.reverse()
    origin = engine.clock()
    skipped = 0.0

    def now() -> float:
        return engine.clock() - origin + skipped

    requests: dict[str, TraceRequest] = {}
    first_token: dict[str, float] = {}
    # output tokens, first token time, finished time, preemptions: `RequestResult`'s order
    finished: dict[str, tuple[int, float, float, int]] = {}
    tally = StepTally(keep=True)
    engine.add_step_observer(tally)
    try:
        while pending or engine.has_unfinished_requests():
            while pending and pending[-1][1].arrival_time <= now():
                index, request = pending.pop()
                prompt = [rng.randrange(3, vocab) for _ in range(request.prompt_len)]
                params = SamplingParams(
                    temperature=0.0, max_tokens=request.output_len, ignore_eos=True
                )
                arrival = origin + request.arrival_time - skipped  # on the engine's clock
                requests[engine.add_request(str(index), prompt, params, arrival)] = request
            if not engine.has_unfinished_requests():
                skipped += pending[-1][1].arrival_time - now()
                continue
            outputs = engine.step()
            t = now()
            for output in outputs:
                first_token.setdefault(output.request_id, t)
                if output.finished:
                    num_preemptions = output.metrics.num_preemptions if output.metrics else 0
                    tokens = len(output.outputs[0].token_ids)
                    first = first_token[output.request_id]
                    finished[output.request_id] = (tokens, first, t, num_preemptions)
    finally:
        engine.remove_step_observer(tally)
    results = [
        RequestResult(rid, request.arrival_time, request.prompt_len, *finished[rid])
        for rid, request in requests.items()
    ]
    results.sort(key=lambda r: int(r.request_id))
    num_preemptions = sum(len(r.plan.preempted) for r in tally.steps)
    return tally.result(results, now(), num_preemptions)
