"""A discrete-event simulator: the engine's own step loop with a cost model in place of the model.

It serves a trace with a real `LLMEngine` and the *same* scheduler and `KVCacheManager` objects
the engine serves with (`FCFSScheduler`, `SkipJoinMLFQScheduler` and its variants), so a policy
measured here is the policy that serves. Only two parts differ: the runner is a
`CostModelRunner`, whose "forward pass" advances a simulated clock by the step's predicted time
and returns no real logits, and the `OutputProcessor` is a `SimulatedOutputProcessor`, which
appends a made-up token to every sampling sequence instead of sampling one. Everything else --
scheduling, forks of parallel samples, stop checks, request metrics, step records -- is the
engine's. Outputs have fixed lengths (`max_tokens` with `ignore_eos`), as in the papers'
trace-driven evaluations (vLLM §6.1, FastServe §6.1); `minipaged.sim.profiling` replays a trace
on the real engine for comparison.

Step time = compute (`CostModel.step_time` of the step's shape) + swaps on the critical path;
swaps moved ahead of time for later steps (proactive swapping, FastServe §4.2) overlap with the
compute, as on a GPU with a separate copy stream: `max(compute, ahead) + the rest`.

Per request it reports time to first token, job completion time (JCT: finish - arrival) and
normalized latency (JCT / output tokens); overall, throughput and swap traffic.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from minipaged.engine.engine import LLMEngine
from minipaged.engine.postprocess import OutputProcessor, StepUpdate
from minipaged.engine.record import StepRecord
from minipaged.kv.manager import KVCacheManager
from minipaged.models.checkpoint.model_config import ModelConfig
from minipaged.models.registry import FAMILIES
from minipaged.sampling.params import SamplingParams
from minipaged.sampling.sequence import GroupMember, Sequence, SequenceGroup
from minipaged.sampling.stopping import finish_if_stopped
from minipaged.sched.base import Scheduler, SchedulerConfig, SchedulerFactory
from minipaged.sched.cost_model import CostModel, StepShape, step_shape
from minipaged.sched.fcfs import FCFSScheduler
from minipaged.sched.output import SchedulerOutput
from minipaged.sim.traces import TraceRequest

# The sampler's part of beam search in a simulation, called after each step's made-up tokens
# are appended: (scheduler, the step's sampling sequences with their requests, the engine's
# sequence-id counter). Parallel samples need none: the engine forks them itself.
SampleHook = Callable[[Scheduler, list[GroupMember], Iterator[int]], None]
SIMULATED_VOCAB = 1 << 30  # made-up prompt ids are any non-negative int32 below this

# -- data types -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestResult:
    """One request's times, in seconds of simulated (or measured) time."""

    request_id: str
    arrival_time: float
    prompt_len: int
    output_len: int
    first_token_time: float
    finished_time: float
    num_preemptions: int = 0

    @property
    def ttft(self) -> float:
        return self.first_token_time - self.arrival_time

    @property
    def jct(self) -> float:
        """Job completion time: arrival to last token."""
        return self.finished_time - self.arrival_time

    @property
    def normalized_latency(self) -> float:
        """JCT per output token (the vLLM paper's metric)."""
        return self.jct / self.output_len


@dataclass
class SimulationResult:
    """Everything a run measured."""

    requests: list[RequestResult]
    makespan: float
    num_steps: int
    swapped_out_blocks: int
    swapped_in_blocks: int
    swap_blocks_ahead: int
    num_preemptions: int
    steps: list[StepRecord] = field(default_factory=list)  # with record_steps=True

    def _values(self, name: str) -> np.ndarray:
        return np.array([getattr(r, name) for r in self.requests])

    @property
    def mean_jct(self) -> float:
        return float(self._values("jct").mean())

    @property
    def p95_jct(self) -> float:
        return float(np.percentile(self._values("jct"), 95))

    @property
    def mean_normalized_latency(self) -> float:
        return float(self._values("normalized_latency").mean())

    @property
    def p95_normalized_latency(self) -> float:
        return float(np.percentile(self._values("normalized_latency"), 95))

    @property
    def mean_ttft(self) -> float:
        return float(self._values("ttft").mean())

    @property
    def throughput(self) -> float:
        """Requests per second over the whole run."""
        return len(self.requests) / self.makespan if self.makespan > 0 else 0.0

    @property
    def token_throughput(self) -> float:
        """Output tokens per second."""
        tokens = sum(r.output_len for r in self.requests)
        return tokens / self.makespan if self.makespan > 0 else 0.0

    def summary(self) -> dict[str, float]:
        return {
            "mean_jct": self.mean_jct,
            "p95_jct": self.p95_jct,
            "mean_normalized_latency": self.mean_normalized_latency,
            "p95_normalized_latency": self.p95_normalized_latency,
            "mean_ttft": self.mean_ttft,
            "throughput": self.throughput,
            "token_throughput": self.token_throughput,
            "swapped_blocks": self.swapped_out_blocks + self.swapped_in_blocks,
            "swap_blocks_ahead": self.swap_blocks_ahead,
            "num_preemptions": self.num_preemptions,
            "num_steps": self.num_steps,
        }


# -- the simulated parts of the engine -----------------------------------------------------------


def step_duration(cost: CostModel, shape: StepShape, swapped: int, ahead: int) -> float:
    """A step's time: compute, overlapped with the swaps made ahead of time, plus the others."""
    compute = cost.step_time(shape)
    return max(compute, cost.swap_time(ahead)) + cost.swap_time(swapped - ahead)


class SimulatedClock:
    """The simulated time, in seconds: the engine's clock in a simulation."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CostModelRunner:
    """The engine's runner in a simulation: a step's "forward pass" advances the clock by the
    time the cost model predicts for it, and returns logits of width 1 (never read)."""

    def __init__(self, cost: CostModel, clock: SimulatedClock) -> None:
        self.cost, self.clock = cost, clock

    def execute(self, plan: SchedulerOutput) -> Tensor:
        if plan.is_empty:
            raise RuntimeError(f"the scheduler made no progress at t={self.clock.now:.3f}s")
        swapped = len(plan.swap_in) + len(plan.swap_out)
        shape = step_shape(plan.scheduled)
        self.clock.now += step_duration(self.cost, shape, swapped, plan.num_swap_blocks_ahead)
        return torch.zeros(sum(s.needs_logits for s in plan.scheduled), 1)

    def close(self) -> None:
        """Nothing to release."""


class SimulatedOutputProcessor(OutputProcessor):
    """The engine's processor with a made-up token (id 0) for every sampling sequence instead of
    a sampled one, then `on_sample` (a beam-search simulation's forks and drops); it keeps the
    requests that finished, for the results."""

    def __init__(self, *args: object, on_sample: SampleHook | None = None, **kwargs: object):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.on_sample = on_sample
        self.finished: list[SequenceGroup] = []

    def update(self, update: StepUpdate, logits: Tensor) -> StepUpdate:
        update = super().update(update, logits)
        self.finished += update.finished
        return update

    def sample_isolated(
        self, members: list[GroupMember], logits: Tensor, update: StepUpdate
    ) -> None:
        samples = self.samples_of(members)  # forks a finished prompt's parallel samples
        for sample in samples:
            sample.seq.append_token(0, 0.0)
        if self.on_sample is not None:
            self.on_sample(self.scheduler, members, self.seq_ids)
        eos, max_len = self.eos_token_ids, self.max_model_len
        for group in dict.fromkeys(sample.group for sample in samples):  # forks, beams included
            for seq in group.get_unfinished_seqs():
                finish_if_stopped(seq, group.sampling_params, eos, max_len)


class StepTally:
    """A step observer counting steps and swapped blocks, keeping the records if asked."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self.steps: list[StepRecord] = []
        self.num_steps = self.swapped_out = self.swapped_in = self.ahead = 0

    def __call__(self, record: StepRecord) -> None:
        self.num_steps += 1
        self.swapped_out += len(record.plan.swap_out)
        self.swapped_in += len(record.plan.swap_in)
        self.ahead += record.plan.num_swap_blocks_ahead
        if self.keep:
            self.steps.append(record)

    def result(
        self, requests: list[RequestResult], makespan: float, num_preemptions: int
    ) -> SimulationResult:
        """What a run measured: its requests and makespan, and the steps tallied here."""
        return SimulationResult(
            requests=requests,
            makespan=makespan,
            num_steps=self.num_steps,
            swapped_out_blocks=self.swapped_out,
            swapped_in_blocks=self.swapped_in,
            swap_blocks_ahead=self.ahead,
            num_preemptions=num_preemptions,
            steps=self.steps,
        )


# -- the simulation -------------------------------------------------------------------------------


def simulate(
    trace: Collection[TraceRequest] | None,
    cost: CostModel,
    scheduler: SchedulerFactory = FCFSScheduler,
    *,
    num_gpu_blocks: int | None = None,
    block_size: int = 16,
    num_cpu_blocks: int = 0,
    config: SchedulerConfig | None = None,
    record_steps: bool = False,
    max_steps: int = 10_000_000,
    groups: Collection[SequenceGroup] | None = None,
    kv_manager: KVCacheManager | None = None,
    on_sample: SampleHook | None = None,
) -> SimulationResult:
    """Serve `trace` with `scheduler(config, kv_manager)` and return what happened.

    The requests come either as a `trace` (made-up prompts, fixed output lengths) or, with
    `trace=None`, as `groups` giving each request's id, prompt tokens (so requests can share a
    prefix), sampling parameters and arrival time. The KV cache is a fresh
    `KVCacheManager(num_gpu_blocks, block_size)` without prefix caching, or `kv_manager` as
    given (prefix caching on, say). `on_sample` is the sampler's part of beam search (see
    `SampleHook`).

    A scheduler that wants a cost model (`needs_cost_model`) and has none gets `cost`. Requests
    the cache can never hold are rejected by the scheduler's `add` (`RequestRejectedError`).
    """
    requests = _requests(trace, groups)
    if kv_manager is None:
        if num_gpu_blocks is None:
            raise ValueError("simulate needs num_gpu_blocks (or a ready kv_manager)")
        kv_manager = KVCacheManager(
            num_gpu_blocks, block_size, num_cpu_blocks=num_cpu_blocks, enable_prefix_caching=False
        )
    if config is None:
        longest = max(g.seqs[0].get_prompt_len() + g.sampling_params.max_tokens for g in requests)
        config = SchedulerConfig(max_model_len=longest + 1)
    sched = scheduler(config, kv_manager)
    if sched.needs_cost_model and getattr(sched, "cost_model", None) is None:
        sched.cost_model = cost  # type: ignore[attr-defined]
    clock = SimulatedClock()
    engine = LLMEngine(
        None,
        simulated_model(config.max_model_len),
        scheduler=sched,
        clock=clock,
        runner=CostModelRunner(cost, clock),  # type: ignore[arg-type]
        processor=functools.partial(SimulatedOutputProcessor, on_sample=on_sample),
    )
    processor = engine.processor
    assert isinstance(processor, SimulatedOutputProcessor)
    tally = StepTally(keep=record_steps)
    engine.add_step_observer(tally)
    pending = sorted(requests, key=lambda g: g.arrival_time)
    pending.reverse()  # pop() from the end: the earliest arrival
    while pending or engine.has_unfinished_requests():
        while pending and pending[-1].arrival_time <= clock.now:
            group = pending.pop()
            engine.add_request(
                group.request_id, group.prompt_token_ids, group.sampling_params,
                arrival_time=group.arrival_time,
            )
        if not engine.has_unfinished_requests():
            clock.now = pending[-1].arrival_time
            continue
        engine.step()
        if tally.num_steps > max_steps:
            raise RuntimeError(f"gave up after {max_steps} steps")
    position = {g.request_id: i for i, g in enumerate(requests)}
    results = sorted(map(request_result, processor.finished), key=lambda r: position[r.request_id])
    first_arrival = min((g.arrival_time for g in requests), default=0.0)
    return tally.result(results, clock.now - first_arrival, sched.num_preemptions)


def simulated_model(max_model_len: int) -> ModelConfig:
    """What the engine reads of a model, for a simulation: a vocabulary every made-up prompt
    id is in, the context, no EOS (outputs run to `max_tokens`). The sizes are never used."""
    return ModelConfig(
        family=FAMILIES["llama"], vocab_size=SIMULATED_VOCAB, hidden_size=1, num_layers=1,
        num_heads=1, num_kv_heads=1, head_dim=1, intermediate_size=1,
        max_position_embeddings=max_model_len,
    )


def request_result(group: SequenceGroup) -> RequestResult:
    """A finished request's times and lengths (its first sample's)."""
    seq, metrics = group.seqs[0], group.metrics
    assert metrics.first_token_time is not None and metrics.finished_time is not None
    return RequestResult(
        group.request_id,
        group.arrival_time,
        seq.get_prompt_len(),
        seq.get_output_len(),
        metrics.first_token_time,
        metrics.finished_time,
        metrics.num_preemptions,
    )


def _requests(
    trace: Collection[TraceRequest] | None, groups: Collection[SequenceGroup] | None
) -> list[SequenceGroup]:
    """The requests to serve, from exactly one of a trace or ready groups."""
    if (trace is None) == (groups is None):
        raise ValueError("simulate takes exactly one of trace and groups (the other None)")
    if groups is None:
        assert trace is not None
        return [_make_group(index, request) for index, request in enumerate(trace)]
    groups = list(groups)
    if len({g.request_id for g in groups}) != len(groups):
        raise ValueError("simulate needs a distinct request_id for every group")
    return groups


def _make_group(index: int, request: TraceRequest) -> SequenceGroup:
    """A request with made-up prompt tokens and a fixed output length."""
    prompt = [(7 * index + i) % 30_000 + 3 for i in range(request.prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)
    seq = Sequence(index, prompt)
    return SequenceGroup(str(index), [seq], params, arrival_time=request.arrival_time)
