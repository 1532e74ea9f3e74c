"""`SamplingParams`: how a request chooses its tokens, named, defaulted and validated as in vLLM.

Every out-of-range value, and every combination that cannot mean anything (beam search with a
temperature, `n > 1` with greedy sampling, ...), raises a `ValueError` naming the field and the
allowed values, before the request reaches the engine. The sampler that applies these settings is
`minipaged.sampling.sampler`; beam search's scoring is `minipaged.sampling.beam_scoring`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

# Temperatures below this are greedy (as in vLLM): dividing by them would overflow.
SAMPLING_EPS = 1e-5
# The most alternatives `logprobs` may ask for a token (vLLM's default `max_logprobs`).
MAX_LOGPROBS = 20
# Range of the seeds `torch.Generator.manual_seed` accepts without wrapping.
MAX_SEED = 2**64


class SamplingType(enum.Enum):
    """How a request picks its tokens."""

    GREEDY = "greedy"  # argmax, temperature 0
    RANDOM = "random"  # drawn with the process-wide (or sampler's) random generator
    RANDOM_SEED = "random_seed"  # drawn with the request's own seeded generator
    BEAM = "beam"  # beam search: the engine keeps the best `beam_width` continuations


@dataclass
class SamplingParams:
    """Per-request generation settings, named and defaulted as in vLLM.

    `top_k`: 0 means "off" (all tokens); vLLM's older spelling -1 is accepted and stored as 0.
    `stop` may be one string or a list; it is stored as a list. Matched stop strings are cut from
    the output text (the tokens stay in `token_ids`, as in vLLM).
    `logprobs=k` returns the `k` most likely alternatives of each output token, plus the chosen
    one. Reported log-probabilities are those of the model's distribution after penalties and
    bans, before temperature and truncation (so the same text scores the same at any
    temperature, and beam search ranks by the very same numbers).
    Beam search (`use_beam_search`) is deterministic: it needs temperature 0 and no truncation,
    keeps `beam_width` beams and returns the best `n <= beam_width` of them, ranked by
    `cumulative_logprob / seq_len ** length_penalty`.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    use_beam_search: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        _check_int("n", self.n, low=1)
        _check_float("temperature", self.temperature, "temperature >= 0", lambda x: x >= 0)
        _check_int("top_k", self.top_k, low=-1, allowed="-1 or 0 (off) or an integer >= 1")
        if self.top_k == -1:
            self.top_k = 0
        _check_float("top_p", self.top_p, "0 < top_p <= 1", lambda x: 0 < x <= 1)
        _check_float("min_p", self.min_p, "0 <= min_p <= 1", lambda x: 0 <= x <= 1)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, allowed="None or an integer in [0, 2**64)")
            if self.seed >= MAX_SEED:
                raise ValueError(f"seed must be None or an integer in [0, 2**64), got {self.seed}")
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            allowed = f"None or an integer in [0, {MAX_LOGPROBS}]"
            _check_int("logprobs", self.logprobs, low=0, allowed=allowed)
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(f"logprobs must be {allowed}, got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), f"-2 <= {name} <= 2", lambda x: -2 <= x <= 2)
        _check_float(
            "repetition_penalty", self.repetition_penalty, "repetition_penalty > 0", lambda x: x > 0
        )
        if not isinstance(self.use_beam_search, bool):
            raise ValueError(f"use_beam_search must be a bool, got {self.use_beam_search!r}")
        _check_int("beam_width", self.beam_width, low=1)
        _check_float("length_penalty", self.length_penalty, "a finite float", lambda x: True)
        if self.use_beam_search:
            self._check_beam_search()
        else:
            self._check_not_beam_search()

    def _check_beam_search(self) -> None:
        if self.n > self.beam_width:
            raise ValueError(
                f"n must be <= beam_width ({self.beam_width}) with beam search, got {self.n}"
            )
        if self.temperature >= SAMPLING_EPS:
            raise ValueError(
                f"temperature must be 0 with beam search (it is deterministic), "
                f"got {self.temperature}"
            )
        for name, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)):
            if getattr(self, name) != off:
                raise ValueError(
                    f"{name} must be {off} (off) with beam search, got {getattr(self, name)}"
                )

    def _check_not_beam_search(self) -> None:
        if self.beam_width != 1:
            raise ValueError(
                f"beam_width must be 1 unless use_beam_search=True, got {self.beam_width}"
            )
        if self.length_penalty != 1.0:
            raise ValueError(
                f"length_penalty must be 1.0 unless use_beam_search=True, got {self.length_penalty}"
            )
        if self.n > 1 and self.temperature < SAMPLING_EPS:
            raise ValueError(
                f"n must be 1 with greedy sampling (temperature 0 gives n identical outputs), "
                f"got {self.n}"
            )

    @property
    def sampling_type(self) -> SamplingType:
        if self.use_beam_search:
            return SamplingType.BEAM
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (greedy sampling or beam search)."""
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _check_int(name: str, value: object, low: int, allowed: str | None = None) -> None:
    allowed = allowed or f"an integer >= {low}"
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _check_float(name: str, value: object, allowed: str, ok: Callable[[float], bool]) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not ok(value)
    ):
        raise ValueError(f"{name} must be a finite number with {allowed}, got {value!r}")


def _normalise_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return list(stops)


def _normalise_stop_token_ids(ids: object) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
    ):
        raise ValueError(f"stop_token_ids must be a list of token ids >= 0, got {ids!r}")
    return list(ids)
