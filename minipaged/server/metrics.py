"""`GET /metrics`: the engine's state and the requests' latencies in Prometheus' text format.

Names follow vLLM's (`vllm:num_requests_running` here is `minipaged:num_requests_running`):

* gauges of the engine, read by `read_engine_stats` -- the one function that knows where the
  engine keeps them -- after every step of the engine loop: requests running / waiting /
  swapped, KV blocks free and in all, KV-cache usage, the prefix cache's hit rate, and the
  number of preemptions so far;
* histograms of each finished request's time to first token, time per output token and
  end-to-end latency (from its arrival at the server), and counters of prompt and generated
  tokens and of finished requests by finish reason ("stop", "length", "abort").

Each server has its own registry, so several can run in one process (tests, notebooks).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from minipaged.sampling.sequence import RequestOutput

PREFIX = "minipaged:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Bucket bounds in seconds: a CPU step takes milliseconds to a second.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)

# -- data types -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's queues and KV cache."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0

    @property
    def kv_cache_usage(self) -> float:
        """The fraction of device KV blocks in use."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


def read_engine_stats(engine: Any) -> EngineStats:
    """The engine's state, through its public attributes (the loop thread calls this)."""
    scheduler, kv_manager = engine.scheduler, engine.kv_manager
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_swapped=len(scheduler.swapped),
        num_blocks=kv_manager.num_gpu_blocks,
        num_free_blocks=kv_manager.num_free_blocks,
        prefix_cache_hit_rate=kv_manager.prefix_cache_hit_rate,
        num_preemptions=scheduler.num_preemptions,
    )


# -- the metrics ----------------------------------------------------------------------------------


class ServerMetrics:
    """The registry of one server: the engine loop reports to it, `/metrics` renders it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.stats = EngineStats()
        self.registry.register(_EngineCollector(self))
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from a request's arrival to its first output token.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time between a request's output tokens after the first.",
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from a request's arrival to its last output token.",
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", registry=self.registry
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated.", registry=self.registry
        )
        self.requests = Counter(
            PREFIX + "request_success",
            "Finished requests, by finish reason.",
            ["finished_reason"],
            registry=self.registry,
        )

    def observe_finished(self, output: RequestOutput) -> None:
        """A request finished (stopped or ran to its length): record its latencies."""
        self.requests.labels(finished_reason=_finish_reason(output)).inc()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        metrics = output.metrics
        if metrics is None or metrics.first_token_time is None:
            return
        self.ttft.observe(metrics.first_token_time - metrics.arrival_time)
        if metrics.finished_time is not None:
            self.e2e.observe(metrics.finished_time - metrics.arrival_time)
            decoded = max(len(c.token_ids) for c in output.outputs) - 1
            if decoded > 0:
                self.tpot.observe((metrics.finished_time - metrics.first_token_time) / decoded)

    def observe_aborted(self) -> None:
        self.requests.labels(finished_reason="abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Turns the latest `EngineStats` into gauges (and the preemption counter) at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        stats = self.metrics.stats
        for name, text, value in (
            ("num_requests_running", "Requests with KV blocks on the device.", stats.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("num_requests_swapped", "Requests swapped out to host memory.", stats.num_swapped),
            ("num_blocks", "KV blocks on the device.", stats.num_blocks),
            ("num_free_blocks", "Free KV blocks on the device.", stats.num_free_blocks),
            ("kv_cache_usage_perc", "Fraction of device KV blocks in use.", stats.kv_cache_usage),
            (
                "prefix_cache_hit_rate",
                "Fraction of looked-up prompt blocks found in the prefix cache.",
                stats.prefix_cache_hit_rate,
            ),
        ):
            yield GaugeMetricFamily(PREFIX + name, text, value=value)
        yield CounterMetricFamily(
            PREFIX + "num_preemptions", "Preemptions so far.", value=stats.num_preemptions
        )


def _finish_reason(output: RequestOutput) -> str:
    """A request's reason: "length" if any of its choices ran to its length, else "stop"."""
    return "length" if any(c.finish_reason == "length" for c in output.outputs) else "stop"


def parse_metrics(text: str) -> dict[str, float]:
    """Samples of a `/metrics` page by name (labels kept in the name), for tests and notebooks."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values
