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

from collections.abc import Iterator, Sequence
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

# The engine's gauges, by the names `read_engine_stats` gives them, and their help texts.
ENGINE_GAUGES = {
    "num_requests_running": "Requests with KV blocks on the device.",
    "num_requests_waiting": "Requests waiting to be scheduled.",
    "num_requests_swapped": "Requests swapped out to host memory.",
    "num_blocks": "KV blocks on the device.",
    "num_free_blocks": "Free KV blocks on the device.",
    "kv_cache_usage_perc": "Fraction of device KV blocks in use.",
    "prefix_cache_hit_rate": "Fraction of looked-up prompt blocks found in the prefix cache.",
}

# -- the engine's state ---------------------------------------------------------------------------


def read_engine_stats(engine: Any) -> dict[str, float]:
    """A snapshot of the engine's queues and KV cache by metric name (`ENGINE_GAUGES` and
    "num_preemptions"), through its public attributes (the loop thread calls this)."""
    scheduler, kv_manager = engine.scheduler, engine.kv_manager
    blocks, free = kv_manager.num_gpu_blocks, kv_manager.num_free_blocks
    return {
        "num_requests_running": len(scheduler.running),
        "num_requests_waiting": len(scheduler.waiting),
        "num_requests_swapped": len(scheduler.swapped),
        "num_blocks": blocks,
        "num_free_blocks": free,
        "kv_cache_usage_perc": 1.0 - free / blocks if blocks else 0.0,
        "prefix_cache_hit_rate": kv_manager.prefix_cache_hit_rate,
        "num_preemptions": scheduler.num_preemptions,
    }


# -- the metrics ----------------------------------------------------------------------------------


class ServerMetrics:
    """The registry of one server: the engine loop reports to it, `/metrics` renders it. It
    collects the engine's gauges itself, from the latest `stats`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.stats: dict[str, float] = dict.fromkeys([*ENGINE_GAUGES, "num_preemptions"], 0)
        self.registry.register(self)
        self.ttft = self._histogram(
            "time_to_first_token_seconds",
            "Time from a request's arrival to its first output token.",
            TTFT_BUCKETS,
        )
        self.tpot = self._histogram(
            "time_per_output_token_seconds",
            "Mean time between a request's output tokens after the first.",
            TPOT_BUCKETS,
        )
        self.e2e = self._histogram(
            "e2e_request_latency_seconds",
            "Time from a request's arrival to its last output token.",
            E2E_BUCKETS,
        )
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = self._counter("generation_tokens", "Tokens generated.")
        self.requests = self._counter(
            "request_success", "Finished requests, by finish reason.", ["finished_reason"]
        )

    def _histogram(self, name: str, text: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(PREFIX + name, text, buckets=buckets, registry=self.registry)

    def _counter(self, name: str, text: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(PREFIX + name, text, labels, registry=self.registry)

    def observe_finished(self, output: RequestOutput) -> None:
        """A request finished (stopped or ran to its length): record its latencies. Its reason
        is "length" if any of its choices ran to its length, else "stop"."""
        length = any(c.finish_reason == "length" for c in output.outputs)
        self.requests.labels(finished_reason="length" if length else "stop").inc()
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

    def collect(self) -> Iterator[Metric]:
        """The latest `stats` as gauges (and the preemption counter), at scrape time."""
        for name, text in ENGINE_GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, text, value=self.stats[name])
        yield CounterMetricFamily(
            PREFIX + "num_preemptions", "Preemptions so far.", value=self.stats["num_preemptions"]
        )


def parse_metrics(text: str) -> dict[str, float]:
    """Samples of a `/metrics` page by name (labels kept in the name), for tests and notebooks."""
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in lines)}
