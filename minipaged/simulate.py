"""A discrete-event simulator: the engine's loop with a cost model in place of the model.

It drives the *same* scheduler and `KVCacheManager` objects the engine uses (`FCFSScheduler`,
`SkipJoinMLFQScheduler` and its variants), so a policy measured here is the policy that serves.
Each step: admit the requests that have arrived, `schedule(now)`, advance the clock by the
step's predicted time, append a made-up token to every sequence that samples, free what
finished. Outputs have fixed lengths (`max_tokens` with `ignore_eos`), as in the papers'
trace-driven evaluations (vLLM §6.1, FastServe §6.1).

Step time = compute (`CostModel.step_time` of the step's shape) + swaps on the critical path;
swaps moved ahead of time for later steps (proactive swapping, FastServe §4.2) overlap with the
compute, as on a GPU with a separate copy stream: `max(compute, ahead) + the rest`.

Per request it reports time to first token, job completion time (JCT: finish - arrival) and
normalized latency (JCT / output tokens); overall, throughput and swap traffic.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from minipaged.cost_model import CostModel, StepShape
from minipaged.kv_cache import KVCacheManager
from minipaged.sampling import SamplingParams
from minipaged.scheduler import FCFSScheduler, ScheduledSequence, Scheduler, SchedulerConfig
from minipaged.sequence import Sequence as Seq
from minipaged.sequence import SequenceGroup, check_stop
from minipaged.traces import TraceRequest, sharegpt_like

if TYPE_CHECKING:
    from minipaged.engine import LLMEngine

SchedulerFactory = Callable[[SchedulerConfig, KVCacheManager], Scheduler]
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


@dataclass(frozen=True)
class StepRecord:
    """One simulated step, for pictures: when, who ran, and each job's queue level."""

    start: float
    end: float
    request_ids: tuple[str, ...]
    levels: dict[str, int] = field(default_factory=dict)  # MLFQ only: request -> level
    num_running: int = 0  # requests holding KV memory (running) at the step's end


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
    steps: list[StepRecord] = field(default_factory=list)  # only with record_steps=True

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
    trace: Sequence[TraceRequest] | None,
    cost: CostModel,
    scheduler: SchedulerFactory = FCFSScheduler,
    *,
    num_blocks: int | None = None,
    block_size: int = 16,
    num_host_blocks: int = 0,
    config: SchedulerConfig | None = None,
    record_steps: bool = False,
    max_steps: int = 10_000_000,
    groups: Sequence[SequenceGroup] | None = None,
    kv_cache: KVCacheManager | None = None,
    on_sample: SampleHook | None = None,
) -> SimulationResult:
    """Serve `trace` with `scheduler(config, kv_cache)` and return what happened.

    The requests come either as a `trace` (made-up prompts, fixed output lengths) or, with
    `trace=None`, as ready `groups`: real prompt tokens, so requests can share a prefix, and any
    sampling parameters. The KV cache is a fresh `KVCacheManager(num_blocks, block_size)` without
    prefix caching, or `kv_cache` as given (prefix caching on, say). `on_sample`, called after each
    step's tokens are appended, is the sampler's part of parallel sampling and beam search: it
    forks and drops sequences (vLLM §4.4); stops are then checked on every unfinished sequence of
    each group that sampled.

    A scheduler that wants a cost model (`needs_cost_model`) and has none gets `cost`. Requests
    the cache can never hold are rejected by the scheduler's `add` (`RequestRejectedError`).
    """
    requests = _requests(trace, groups)
    if kv_cache is None:
        if num_blocks is None:
            raise ValueError("simulate needs num_blocks (or a ready kv_cache)")
        kv_cache = KVCacheManager(
            num_blocks, block_size, num_host_blocks=num_host_blocks, enable_prefix_caching=False
        )
    if config is None:
        longest = max(g.seqs[0].get_prompt_len() + g.sampling_params.max_tokens for g in requests)
        config = SchedulerConfig(max_model_len=longest + 1)
    sched = scheduler(config, kv_cache)
    if sched.needs_cost_model and getattr(sched, "cost_model", None) is None:
        sched.cost_model = cost  # type: ignore[attr-defined]
    position = {g.request_id: i for i, g in enumerate(requests)}
    pending = sorted(requests, key=lambda g: g.arrival_time)
    pending.reverse()  # pop() from the end: the earliest arrival
    results: list[RequestResult] = []
    first_token: dict[str, float] = {}
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
        duration = step_duration(cost, StepShape.of(out), num_swaps, out.num_swap_blocks_ahead)
        sched.mark_computed(out)
        start, now = now, now + duration
        swapped_out += len(out.swap_out)
        swapped_in += len(out.swap_in)
        ahead_total += out.num_swap_blocks_ahead
        sampled = [item for item in out.scheduled if item.needs_logits]
        for item in sampled:
            first_token.setdefault(item.group.request_id, now)
            item.seq.append_token(0, 0.0)
        if on_sample is not None:
            next_seq_id = on_sample(sched, sampled, next_seq_id)
        touched = {id(item.group): item.group for item in sampled}
        for group in touched.values():  # forked samples and beams included
            for seq in group.get_unfinished_seqs():
                decision = check_stop(seq, group.sampling_params)
                if decision is not None:
                    seq.finish(decision)
        if record_steps:
            jobs = getattr(sched, "jobs", {})
            steps.append(
                StepRecord(
                    start,
                    now,
                    tuple(dict.fromkeys(s.group.request_id for s in out.scheduled)),
                    {rid: job.level for rid, job in jobs.items()},
                    len(sched.running),
                )
            )
        for group in sched.finish_step():
            seq = group.seqs[0]
            results.append(
                RequestResult(
                    group.request_id,
                    group.arrival_time,
                    seq.get_prompt_len(),
                    seq.get_output_len(),
                    first_token[group.request_id],
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


def _requests(
    trace: Sequence[TraceRequest] | None, groups: Sequence[SequenceGroup] | None
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
    seq = Seq(index, prompt)
    return SequenceGroup(str(index), [seq], params, arrival_time=request.arrival_time)


# -- the same trace on the real engine -------------------------------------------------------------


def replay_on_engine(
    engine: LLMEngine,
    trace: Sequence[TraceRequest],
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> SimulationResult:
    """Serve `trace` on a real engine (random prompt tokens, fixed output lengths) and measure
    what `simulate` predicts, for comparison.

    Times are read from `clock`: wall time by default; `time.thread_time` counts only this
    thread's CPU time, which keeps other processes on a shared machine out of the measurement
    (run torch on one thread then). While nothing is in flight the replay jumps to the next
    arrival instead of sleeping, as the simulator does.
    """
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    pending = sorted(enumerate(trace), key=lambda x: x[1].arrival_time)
    pending.reverse()
    preemptions_before = engine.scheduler.num_preemptions
    origin = clock()
    skipped = 0.0

    def now() -> float:
        return clock() - origin + skipped

    requests: dict[str, TraceRequest] = {}
    first_token: dict[str, float] = {}
    finished: dict[str, tuple[float, int, int]] = {}  # time, output tokens, preemptions
    num_steps = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[-1][1].arrival_time <= now():
            index, request = pending.pop()
            prompt = [rng.randrange(3, vocab) for _ in range(request.prompt_len)]
            params = SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)
            requests[engine.add_request(str(index), prompt, params)] = request
        if not engine.has_unfinished_requests():
            skipped += pending[-1][1].arrival_time - now()
            continue
        outputs = engine.step()
        t = now()
        num_steps += 1
        for output in outputs:
            first_token.setdefault(output.request_id, t)
            if output.finished:
                num_preemptions = output.metrics.num_preemptions if output.metrics else 0
                tokens = len(output.outputs[0].token_ids)
                finished[output.request_id] = (t, tokens, num_preemptions)
    results = [
        RequestResult(
            rid,
            request.arrival_time,
            request.prompt_len,
            finished[rid][1],
            first_token[rid],
            finished[rid][0],
            finished[rid][2],
        )
        for rid, request in requests.items()
    ]
    results.sort(key=lambda r: int(r.request_id))
    return SimulationResult(
        requests=results,
        makespan=now(),
        num_steps=num_steps,
        swapped_out_blocks=0,  # not counted on the engine
        swapped_in_blocks=0,
        swap_blocks_ahead=getattr(engine.scheduler, "num_swap_blocks_ahead", 0),
        num_preemptions=engine.scheduler.num_preemptions - preemptions_before,
    )


# -- arrivals -------------------------------------------------------------------------------------


def gamma_arrival_times(
    num_requests: int, rate: float, cv: float, rng: np.random.Generator
) -> np.ndarray:
    """Arrival times with gamma-distributed gaps: mean 1/rate, coefficient of variation `cv`
    (cv 1 is Poisson; larger is burstier, as FastServe's evaluation uses)."""
    if rate <= 0 or cv <= 0:
        raise ValueError(f"rate and cv must be positive, got rate={rate!r}, cv={cv!r}")
    shape = 1.0 / cv**2
    gaps = rng.gamma(shape, 1.0 / (rate * shape), num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def with_arrivals(trace: Sequence[TraceRequest], arrivals: np.ndarray) -> list[TraceRequest]:
    """The same requests at new arrival times."""
    if len(arrivals) != len(trace):
        raise ValueError(f"{len(arrivals)} arrival times for {len(trace)} requests")
    return [
        TraceRequest(float(t), r.prompt_len, r.output_len)
        for t, r in zip(arrivals, trace, strict=True)
    ]


def heavy_tailed(
    num_requests: int,
    seed: int = 0,
    output_median: float = 40.0,
    output_sigma: float = 1.5,
    max_seq_len: int = 2048,
    prompt_median: float | None = None,
    prompt_sigma: float = 1.0,
) -> list[TraceRequest]:
    """ShareGPT-like prompts with heavy-tailed output lengths (log-normal, sigma 1.5: the mean
    is ~3x the median and a few jobs are 10-50x it): the workload where run-to-completion
    suffers most from head-of-line blocking (FastServe §2). With `prompt_median`, prompts are
    log-normal too (long-context jobs: long prefills and large KV caches). All arrive at 0;
    see `with_arrivals`."""
    rng = np.random.default_rng(seed + 7919)
    if prompt_median is None:
        prompts = sharegpt_like(num_requests, seed=seed, max_seq_len=max_seq_len)
        prompt_lens = [r.prompt_len for r in prompts]
    else:
        drawn = np.round(rng.lognormal(np.log(prompt_median), prompt_sigma, num_requests))
        prompt_lens = [int(p) for p in drawn.clip(1, max_seq_len - 1)]
    outputs = np.round(rng.lognormal(np.log(output_median), output_sigma, num_requests))
    return [
        TraceRequest(0.0, p, int(min(max(o, 1), max_seq_len - p)))
        for p, o in zip(prompt_lens, outputs, strict=True)
    ]
