"""How long one engine step takes: a linear cost model fitted to measured steps.

The simulator (`minipaged.sim.simulator`) replaces the model with this, and skip-join MLFQ
(`minipaged.sched.mlfq`, FastServe §4.1) uses it to predict a new job's prefill time, the "first
iteration time" that decides which queue it joins. One step's time is modelled as

    base + per_prefill_token * prefill tokens + per_decode_seq * decoding sequences
         + per_context_token * context tokens the decodes read

(an intercept for the fixed cost of a forward pass -- on a GPU, reading the weights once --,
the prefill's tokens, the decodes' tokens, and the KV cache the decodes attend to), plus
`per_swap_block` seconds for each block copied between the GPU and the CPU pool.

`CostModel.fit` finds the four numbers by least squares from measured steps (the measuring is
done above: `minipaged.runner.profiler` times a model runner's forward passes,
`minipaged.sim.profiling` whole engine steps); `save` / `load` keep a fitted model in a JSON file;
`OPT_13B_A100` gives the papers' set-up from public numbers, for simulations bigger than this
machine. This module depends on nothing else in minipaged.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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

    @property
    def features(self) -> tuple[float, float, float, float]:
        """The regressors of the linear model: intercept, prefill, decode, context."""
        counts = (self.prefill_tokens, self.decode_seqs, self.context_tokens)
        return (1.0, *map(float, counts))


@dataclass(frozen=True)
class CostModel:
    """Seconds per step as a linear function of its shape, plus seconds per swapped block."""

    base: float  # seconds of any non-empty step
    per_prefill_token: float
    per_decode_seq: float
    per_context_token: float
    per_swap_block: float = 0.0  # one block copied from the GPU pool to the CPU pool or back
    name: str = "custom"

    def __post_init__(self) -> None:
        for name, value in dataclasses.asdict(self).items():
            if name != "name" and value < 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {value}")

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

    # -- files ----------------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write this model to a JSON file (a profile to reuse instead of measuring again)."""
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """Read a model written by `save`; a file that is not one is refused, saying why."""
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a saved CostModel is a JSON object, got {data!r}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        required = {n for n, f in fields.items() if f.default is dataclasses.MISSING}
        unknown, missing = sorted(set(data) - set(fields)), sorted(required - set(data))
        if unknown or missing:
            raise ValueError(
                f"{path}: not a saved CostModel (unknown fields {unknown}, missing {missing})"
            )
        for name, value in data.items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if (name == "name") != isinstance(value, str) or (name != "name" and not number):
                raise ValueError(f"{path}: {name} has the wrong type: {value!r}")
        return cls(**data)


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


def step_shape(scheduled: Iterable[Any]) -> StepShape:
    """The shape a step's scheduled sequences (`ScheduledSequence`s) charge for: prefill tokens,
    decoding sequences and the context those decodes attend to."""
    prefill = decode = context = 0
    for item in scheduled:
        if item.is_prefill:
            prefill += item.num_new_tokens
        else:
            decode += 1
            context += item.start + item.num_new_tokens
    return StepShape(prefill, decode, context)
