"""A discrete-event simulator: the engine's loop with a cost model in place of the model.

It drives the *same* scheduler and `KVCacheManager` objects the engine uses (`FCFSScheduler`,
`SkipJoinMLFQScheduler` and its variants), so a policy measured here is the policy that serves.
Each step: admit the requests that have arrived, `schedule(now)`, advance the clock by the
step's predicted time, append a made-up token to every sequence that samples, check stops, free
what finished. Outputs have fixed lengths (`max_tokens` with `ignore_eos`), as in the papers'
trace-driven evaluations (vLLM §6.1, FastServe §6.1). What the engine does alike around a step
-- parallel samples' forks, stop checks, request metrics, the step's record -- is the same code
(`minipaged.engine.step`, `minipaged.sampling.stopping`); `minipaged.sim.profiling` replays a trace
on the real engine for comparison.

Step time = compute (`CostModel.step_time` of the step's shape) + swaps on the critical path;
swaps moved ahead of time for later steps (proactive swapping, FastServe §4.2) overlap with the
compute, as on a GPU with a separate copy stream: `max(compute, ahead) + the rest`.

Per request it reports time to first token, job completion time (JCT: finish - arrival) and
normalized latency (JCT / output tokens); overall, throughput and swap traffic.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import numpy as np

from minipaged.engine.step import (
    StepRecord,
    finish_requests,
    fork_samples,
    mark_first_tokens,
    record_step,
    step_shape,
)
from minipaged.kv.manager import KVCacheManager
from minipaged.sampling.params import SamplingParams
from minipaged.sampling.sequence import Sequence, SequenceGroup
from minipaged.sampling.stopping import finish_if_stopped
from minipaged.sched.base import ScheduledSequence, Scheduler, SchedulerConfig, SchedulerFactory
from minipaged.sched.cost_model import CostModel, StepShape
from minipaged.sched.fcfs import FCFSScheduler
from minipaged.sim.traces import TraceRequest

# The sampler's part of parallel sampling and beam search, called after each step's tokens are
# appended: (scheduler, the step's sampling items, the next free sequence id) -> the next free id.
SampleHook = Callable[[Scheduler, list[ScheduledSequence], int], int]
FORKED_SEQ_IDS = 1_000_000_000  # the first id of a sequence forked by an `on_sample` hook

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


# -- the simulation -------------------------------------------------------------------------------


def step_duration(cost: CostModel, shape: StepShape, swapped: int, ahead: int) -> float:
    """A step's time: compute, overlapped with the swaps made ahead of time, plus the others."""
    compute = cost.step_time(shape)
    return max(compute, cost.swap_time(ahead)) + cost.swap_time(swapped - ahead)


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
    `trace=None`, as ready `groups`: real prompt tokens, so requests can share a prefix, and any
    sampling parameters. The KV cache is a fresh `KVCacheManager(num_gpu_blocks, block_size)`
    without prefix caching, or `kv_manager` as given (prefix caching on, say). `on_sample`, called
    after each step's tokens are appended, is the sampler's part of parallel sampling and beam
    search: it forks and drops sequences (vLLM §4.4); stops are then checked on every unfinished
    sequence of each group that sampled.

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
    position = {g.request_id: i for i, g in enumerate(requests)}
    pending = sorted(requests, key=lambda g: g.arrival_time)
    pending.reverse()  # pop() from the end: the earliest arrival
    results: list[RequestResult] = []
    steps: list[StepRecord] = []
    now, num_steps = 0.0, 0
    swapped_out = swapped_in = ahead_total = 0
    next_seq_id = FORKED_SEQ_IDS

    while pending or sched.has_unfinished():
        while pending and pending[-1].arrival_time <= now:
            sched.add(pending.pop())
        if not sched.has_unfinished():
            now = pending[-1].arrival_time
            continue
        out = sched.schedule(now)
        if out.is_empty:
            raise RuntimeError(f"the scheduler made no progress at t={now:.3f}s")
        num_swaps = len(out.swap_in) + len(out.swap_out)
        shape = step_shape(out.scheduled)
        duration = step_duration(cost, shape, num_swaps, out.num_swap_blocks_ahead)
        sched.mark_computed(out)
        start, now = now, now + duration
        swapped_out += len(out.swap_out)
        swapped_in += len(out.swap_in)
        ahead_total += out.num_swap_blocks_ahead
        sampled = [item for item in out.scheduled if item.needs_logits]
        touched = {id(item.group): item.group for item in sampled}
        mark_first_tokens(touched.values(), now)
        for item in sampled:
            item.seq.append_token(0, 0.0)
        if on_sample is not None:
            next_seq_id = on_sample(sched, sampled, next_seq_id)
        for group in touched.values():  # forked samples and beams included
            for seq in group.get_unfinished_seqs():
                finish_if_stopped(seq, group.sampling_params, (), config.max_model_len)
        if record_steps:
            steps.append(record_step(num_steps, start, now, out, sched))
        for group in finish_requests(sched, now):
            seq = group.seqs[0]
            first_token = group.metrics.first_token_time
            assert first_token is not None  # every finished request sampled
            results.append(
                RequestResult(
                    group.request_id,
                    group.arrival_time,
                    seq.get_prompt_len(),
                    seq.get_output_len(),
                    first_token,
                    now,
                    group.metrics.num_preemptions,
                )
            )
        num_steps += 1
        if num_steps > max_steps:
            raise RuntimeError(f"gave up after {max_steps} steps")
    results.sort(key=lambda r: position[r.request_id])
    first_arrival = min((g.arrival_time for g in requests), default=0.0)
    return SimulationResult(
        requests=results,
        makespan=now - first_arrival,
        num_steps=num_steps,
        swapped_out_blocks=swapped_out,
        swapped_in_blocks=swapped_in,
        swap_blocks_ahead=ahead_total,
        num_preemptions=sched.num_preemptions,
        steps=steps,
    )


def fork_parallel_samples(
    scheduler: Scheduler, sampled: list[ScheduledSequence], next_id: int
) -> int:
    """The `SampleHook` of parallel sampling: the engine's own fork (`fork_samples`) of every
    request whose prompt just finished, with ids from `next_id` on; returns the next free id."""
    seq_ids = itertools.count(next_id)
    for item in sampled:
        if not item.group.sampling_params.use_beam_search:
            fork_samples(scheduler, item.group, item.seq, seq_ids)
    return next(seq_ids)


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
