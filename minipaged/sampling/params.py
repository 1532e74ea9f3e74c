"""`SamplingParams`: how a request chooses its tokens, named, defaulted and validated as in vLLM.

Every value of the wrong type, every out-of-range value, and every combination that cannot mean
anything (beam search with a temperature, `n > 1` with greedy sampling, ...), raises a
`ValueError` naming the field and the allowed values, before the request reaches the engine.
The ranges are what the sampler and the model can compute with, so that no request's settings
can make a step fail (and end the other requests of its batch):

* integers fit an int64 (`MAX_INT64`): the sampler builds int64 tensors of them;
* seeds lie in [0, 2**64), what `torch.Generator.manual_seed` takes without wrapping (it
  refuses 2**64 and beyond with "Overflow when unpacking long long");
* floats are finite; penalties lie in vLLM's ranges (presence and frequency in [-2, 2],
  repetition > 0); `length_penalty` in [-10, 10], so `seq_len ** length_penalty` stays a
  finite, non-zero float for any context an int32 position can index;
* `logprobs` asks for at most `MAX_LOGPROBS` alternatives (vLLM's default `max_logprobs`).

What needs the model is checked when a request is admitted (`minipaged.engine.requests`:
`top_k` and stop token ids up to the vocabulary). The sampler that applies these settings is
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
# The largest integer an int64 tensor holds: the bound of every integer setting.
MAX_INT64 = 2**63 - 1
# The bound of |length_penalty|: (2**31) ** 10 is finite in float64, its inverse non-zero.
MAX_LENGTH_PENALTY = 10.0


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step` returns of a request after a step that changed it (vLLM's enum of
    the same name)."""

    CUMULATIVE = 0  # the whole output so far
    DELTA = 1  # what the step added: new text, tokens, log-probabilities (a stream's kind)
    FINAL_ONLY = 2  # nothing until the request finishes, then the whole output


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
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        _check_int("n", self.n, low=1)
        _check_float("temperature", self.temperature, "temperature >= 0", lambda x: x >= 0)
        _check_int("top_k", self.top_k, low=-1, allowed="-1 or 0 (off) or an integer in [1, 2**63)")
        if self.top_k == -1:
            self.top_k = 0
        _check_float("top_p", self.top_p, "0 < top_p <= 1", lambda x: 0 < x <= 1)
        _check_float("min_p", self.min_p, "0 <= min_p <= 1", lambda x: 0 <= x <= 1)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=MAX_SEED - 1,
                       allowed="None or an integer in [0, 2**64)")
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        _check_bool("ignore_eos", self.ignore_eos)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS,
                       allowed=f"None or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), f"-2 <= {name} <= 2", lambda x: -2 <= x <= 2)
        _check_float(
            "repetition_penalty", self.repetition_penalty, "repetition_penalty > 0", lambda x: x > 0
        )
        _check_bool("use_beam_search", self.use_beam_search)
        _check_int("beam_width", self.beam_width, low=1)
        _check_float("length_penalty", self.length_penalty,
                     f"|length_penalty| <= {MAX_LENGTH_PENALTY}",
                     lambda x: abs(x) <= MAX_LENGTH_PENALTY)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(
                f"output_kind must be a RequestOutputKind, got {shown(self.output_kind)}"
            )
        self._check_combinations()

    def _check_combinations(self) -> None:
        """The settings that cannot mean anything together, with beam search and without."""
        if self.use_beam_search:
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
            return
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
        penalties = (self.presence_penalty, self.frequency_penalty, self.repetition_penalty)
        return penalties != (0.0, 0.0, 1.0)


def _check_int(
    name: str, value: object, low: int, high: int = MAX_INT64, allowed: str | None = None
) -> None:
    """`value` is an int (not a bool) in [low, high], else a ValueError naming `name`."""
    # Every bounded call names its range itself.
    allowed = allowed or f"an integer >= {low} that fits an int64 (<= 2**63 - 1)"
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be {allowed}, got {shown(value)}")


def _check_float(name: str, value: object, allowed: str, ok: Callable[[float], bool]) -> None:
    """`value` is a finite int or float (not a bool) that `ok` accepts, else a ValueError."""
    if isinstance(value, bool) or not is_finite(value) or not ok(value):  # type: ignore[arg-type]
        raise ValueError(f"{name} must be a finite number with {allowed}, got {shown(value)}")


def is_finite(value: object) -> bool:
    """A finite int or float; an int beyond the floats' range (10**400) is not finite either."""
    try:
        return isinstance(value, (int, float)) and math.isfinite(value)
    except OverflowError:
        return False


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {shown(value)}")


def _normalise_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {shown(stop)}")
    return list(stops)


def _normalise_stop_token_ids(ids: object) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_INT64 for t in ids
    ):
        raise ValueError(
            f"stop_token_ids must be a list of token ids in [0, 2**63), got {shown(ids)}"
        )
    return list(ids)


def shown(value: object, limit: int = 80) -> str:
    """`repr(value)` cut to `limit` characters for an error message; an int too long to print
    (Python refuses more than 4,300 digits) is shown by its size."""
    if isinstance(value, int) and value.bit_length() > 256:
        return f"an integer of {value.bit_length()} bits"
    try:
        text = repr(value)
    except Exception:  # a repr that fails must not hide the field's name
        text = f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."
