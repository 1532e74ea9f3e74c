"""Synthetic request traces shaped like the vLLM paper's workloads (Kwon et al. SOSP'23, §6.1).

The paper samples prompt and output lengths from ShareGPT (long prompts with a heavy tail, long
outputs) and Alpaca (short instructions and answers), and draws arrival times from a Poisson
process. The datasets are not shipped here; these generators match the length statistics the
paper reports (Fig. 11), which is all a memory or scheduling simulation needs:

* ShareGPT-like: prompt mean ~161 / median ~35 tokens (a log-normal body plus ~9% long
  pasted-context prompts spread up to the limit), output mean ~338 / median ~271, and
  prompt + output <= `max_seq_len` (2048, OPT's context).
* Alpaca-like: prompt mean ~19, output mean ~58 (log-normal).
* Heavy-tailed (FastServe's setting, §2, §6): ShareGPT-like or log-normal prompts with
  log-normal outputs of sigma 1.5, where a few jobs are 10-50x the median.

Arrivals: a Poisson process, or gamma-distributed gaps for bursty traffic (FastServe's
evaluation); `with_arrivals` puts a trace's requests at new times. Every generator is seeded and
returns requests sorted by arrival time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrives and how long it is (tokens)."""

    arrival_time: float
    prompt_len: int
    output_len: int

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


# ShareGPT-like lengths (calibrated so the clipped samples match the paper's Fig. 11 statistics).
_SHAREGPT_PROMPT_MEDIAN = 30.0
_SHAREGPT_PROMPT_SIGMA = 1.2
_SHAREGPT_LONG_PROMPT_FRACTION = 0.09  # prompts carrying a long pasted context
_SHAREGPT_LONG_PROMPT_RANGE = (256, 2048)
_SHAREGPT_OUTPUT_MEDIAN = 274.0
_SHAREGPT_OUTPUT_SIGMA = 0.66

# Alpaca-like lengths: log-normal with the paper's means.
_ALPACA_PROMPT_MEAN, _ALPACA_PROMPT_SIGMA = 19.0, 0.5
_ALPACA_OUTPUT_MEAN, _ALPACA_OUTPUT_SIGMA = 58.0, 0.8


def poisson_arrival_times(num_requests: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times of a Poisson process with `rate` requests per time unit (starts at 0);
    `rate=inf` makes every request arrive at time 0."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate!r}")
    if np.isinf(rate):
        return np.zeros(num_requests)
    gaps = rng.exponential(1.0 / rate, num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps)


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
    return [replace(r, arrival_time=float(t)) for t, r in zip(arrivals, trace, strict=True)]


def sharegpt_like(
    num_requests: int, rate: float = float("inf"), seed: int = 0, max_seq_len: int = 2048
) -> list[TraceRequest]:
    """A ShareGPT-shaped trace: long, heavy-tailed prompts and long outputs."""
    rng = _rng(num_requests, max_seq_len, seed)
    body = _lognormal(rng, _SHAREGPT_PROMPT_MEDIAN, _SHAREGPT_PROMPT_SIGMA, num_requests)
    long_prompts = rng.integers(*_SHAREGPT_LONG_PROMPT_RANGE, num_requests)
    is_long = rng.random(num_requests) < _SHAREGPT_LONG_PROMPT_FRACTION
    prompt = np.where(is_long, long_prompts, body).clip(1, max_seq_len - 1).astype(int)
    output = _lognormal(rng, _SHAREGPT_OUTPUT_MEDIAN, _SHAREGPT_OUTPUT_SIGMA, num_requests)
    output = np.minimum(output.clip(1, None), max_seq_len - prompt).astype(int)
    return _assemble(poisson_arrival_times(num_requests, rate, rng), prompt, output)


def alpaca_like(
    num_requests: int, rate: float = float("inf"), seed: int = 0, max_seq_len: int = 2048
) -> list[TraceRequest]:
    """An Alpaca-shaped trace: short instructions, short answers."""
    rng = _rng(num_requests, max_seq_len, seed)
    prompt = _lognormal_with_mean(rng, _ALPACA_PROMPT_MEAN, _ALPACA_PROMPT_SIGMA, num_requests)
    output = _lognormal_with_mean(rng, _ALPACA_OUTPUT_MEAN, _ALPACA_OUTPUT_SIGMA, num_requests)
    prompt = prompt.clip(1, max_seq_len - 1)
    output = np.minimum(output, max_seq_len - prompt)
    return _assemble(poisson_arrival_times(num_requests, rate, rng), prompt, output)


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
        drawn = _lognormal(rng, prompt_median, prompt_sigma, num_requests)
        prompt_lens = [int(p) for p in drawn.clip(1, max_seq_len - 1)]
    outputs = _lognormal(rng, output_median, output_sigma, num_requests)
    return [
        TraceRequest(0.0, p, int(min(max(o, 1), max_seq_len - p)))
        for p, o in zip(prompt_lens, outputs, strict=True)
    ]


TRACES = {"sharegpt": sharegpt_like, "alpaca": alpaca_like}


def _rng(num_requests: int, max_seq_len: int, seed: int) -> np.random.Generator:
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests!r}")
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len!r}")
    return np.random.default_rng(seed)


def _lognormal(rng: np.random.Generator, median: float, sigma: float, n: int) -> np.ndarray:
    """`n` log-normal lengths of `median` and `sigma`, rounded to whole tokens."""
    return np.round(rng.lognormal(np.log(median), sigma, n))


def _lognormal_with_mean(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    median = mean / np.exp(sigma**2 / 2)
    return _lognormal(rng, median, sigma, n).clip(1, None).astype(int)


def _assemble(arrivals: np.ndarray, prompt: np.ndarray, output: np.ndarray) -> list[TraceRequest]:
    return [
        TraceRequest(float(t), int(p), int(o))
        for t, p, o in zip(arrivals, prompt, output, strict=True)
    ]
