"""`EngineConfig`: everything an engine is built from besides the model, checked at once.

It is a `RunnerConfig` (`minipaged.runner.config`: the device, the KV cache, the batch limits,
tensor parallelism, settled by the device's platform) with the scheduler's settings added.
`SCHEDULERS` (`minipaged.sched.registry`) names the schedulers `EngineConfig.scheduler` may
choose ("fcfs", "mlfq" and the MLFQ ablations); `DTYPES` the model dtypes, which
`DTYPE_CHOICES` extends by "auto" (bfloat16 where the device multiplies it natively,
`Platform.native_bfloat16`; float32 elsewhere). The engine itself is `minipaged.engine.engine`.

The default is exact float32. What bfloat16 changes: weights, activations and the KV cache are
stored with an 8-bit mantissa (about 3 significant digits), so logits move by about 1e-2 and a
greedy choice between two tokens whose logits are that close can flip; from there on the
continuations differ. The norms, the softmax of the attention and the logits are still computed
in float32 (docs/benchmarks.md, "CPU performance", measures the speed and the token agreement).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from minipaged.platforms import BACKENDS, DTYPES, QUANTIZATIONS
from minipaged.runner.config import RunnerConfig
from minipaged.sampling.params import MAX_SEED, is_finite, shown
from minipaged.sched.cost_model import CostModel
from minipaged.sched.mlfq import MLFQConfig
from minipaged.sched.output import PreemptionMode, SchedulerConfig
from minipaged.sched.registry import check_preemption_mode, needs_cost_model

DTYPE_CHOICES = (*DTYPES, "auto")
# The largest size or count a setting may give: block tables, positions and token counts are
# int32 tensors in the attention metadata.
MAX_INT32 = 2**31 - 1
# The range of each memory and time setting (besides being finite): its test, and its words.
FLOAT_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "kv_cache_memory": (lambda value: value > 0, "> 0 GiB"),
    "gpu_memory_utilization": (lambda value: 0 < value <= 1, "in (0, 1]"),
    "swap_space": (lambda value: value >= 0, ">= 0 GiB"),
    "tensor_parallel_timeout": (lambda value: value > 0, "> 0 seconds"),
}


@dataclass
class EngineConfig(RunnerConfig):
    """Everything `LLM(...)` / `LLMEngine.from_pretrained(...)` accepts besides the model path:
    a `RunnerConfig` (its fields first) and the scheduler's settings."""

    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # vLLM's: at most this many tokens of one sequence per step, so a long prompt prefills
    # beside others instead of taking whole steps (0: no limit; needs chunked prefill).
    long_prefill_token_threshold: int = 0
    scheduler: str = "fcfs"
    # MLFQ schedulers: settings replacing the variant's (`MLFQConfig`), and a ready cost model
    # (`CostModel`) or a JSON file of one (`CostModel.save`) so that the engine need not profile
    # this model at start-up. A file that does not exist yet is written with the profile taken.
    mlfq: MLFQConfig | None = None
    cost_model: CostModel | None = None
    cost_model_file: str | Path | None = None
    # "recompute" or "swap", for every scheduler (`PreemptionMode`); None: the scheduler's
    # default (FCFS: recompute single sequences, swap groups; MLFQ: swap).
    preemption_mode: str | None = None
    seed: int = 0  # the engine's generator, for requests without a seed of their own

    def __post_init__(self) -> None:
        """Types and ranges checked, names among their choices, then settled by the device's
        platform (`RunnerConfig`)."""
        check_field_types(self)
        self._check_ranges()
        check_choice("dtype", self.dtype, sorted(DTYPE_CHOICES), None)
        if self.mlfq is not None and not needs_cost_model(self.scheduler):
            raise ValueError(f"mlfq settings need an MLFQ scheduler, got {self.scheduler!r}")
        check_choice("quantization", self.quantization, QUANTIZATIONS, None)
        super().__post_init__()

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's share of the settings (its fields of the same names), for a model of
        `max_model_len` tokens."""
        names = {field.name for field in dataclasses.fields(SchedulerConfig)} - {"max_model_len"}
        return SchedulerConfig(max_model_len=max_model_len,
                               **{name: getattr(self, name) for name in names})

    def _check_ranges(self) -> None:
        """Sizes within int32, memory and time finite and in range, names among their
        choices."""
        sizes = (("block_size", 1, ""), ("num_gpu_blocks", 1, "None or "),
                 ("num_cpu_blocks", 0, "None or "), ("max_num_seqs", 1, ""),
                 ("max_num_batched_tokens", 1, ""), ("long_prefill_token_threshold", 0, ""),
                 ("tensor_parallel_size", 1, ""),
                 ("max_model_len", 2, "None (the model's) or "))  # a prompt token and one more
        for name, low, other in sizes:
            value = getattr(self, name)
            if value is not None and not low <= value <= MAX_INT32:
                raise ValueError(
                    f"{name} must be {other}an integer in [{low}, 2**31 - 1], got {value}"
                )
        for name, (in_range, bounds) in FLOAT_RANGES.items():
            value = getattr(self, name)
            if not is_finite(value):
                raise ValueError(f"{name} must be a finite number, got {shown(value)}")
            if not in_range(value):
                raise ValueError(f"{name} must be {bounds}, got {value}")
        if not 0 <= self.seed < MAX_SEED:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed}")
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, ValueError) as exc:
                raise ValueError(f"device must be None or a torch device, got {self.device!r}: "
                                 f"{exc}") from None
        modes = [mode.value for mode in PreemptionMode]
        check_choice("preemption_mode", self.preemption_mode, modes, None)
        check_preemption_mode(self.scheduler, self.preemption_mode)  # checks the name too
        check_choice("attention_backend", self.attention_backend, list(BACKENDS), None, "auto")


def check_choice(name: str, value: object, choices: Sequence[object], *also: object) -> None:
    """A `ValueError` naming the setting `name` unless `value` is one of `choices` or of `also`
    (None, say: the message lists those first)."""
    if value not in (*also, *choices):
        either = f"{', '.join(map(repr, also))} or " if also else ""
        raise ValueError(f"{name} must be {either}one of {choices}, got {value!r}")


# -- field types ----------------------------------------------------------------------------------


def check_field_types(config: object) -> None:
    """Every field of the dataclass `config` holds a value of its annotated type, else a
    `TypeError` naming the field (an int is a float here, a bool is neither an int nor a float;
    a hint this check cannot read is not checked)."""
    for name, hint in field_types(type(config)).items():
        value = getattr(config, name)
        if not _has_type(value, hint):
            raise TypeError(f"{name} must be {_type_name(hint)}, got {shown(value)}")


@functools.cache
def field_types(cls: type) -> dict[str, object]:
    """The resolved annotations of a dataclass's fields, in the fields' order."""
    hints = typing.get_type_hints(cls)
    return {field.name: hints[field.name] for field in dataclasses.fields(cls)}


def _has_type(value: object, hint: object) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, member) for member in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if hint in (int, float):
        kinds = (int,) if hint is int else (int, float)
        return isinstance(value, kinds) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    if isinstance(origin, type):  # list[int] and the like: the container's type only
        return isinstance(value, origin)
    return True


def _type_name(hint: object) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(member) for member in typing.get_args(hint))
    if hint is type(None):
        return "None"
    if typing.get_origin(hint) is typing.Literal:
        return " or ".join(repr(choice) for choice in typing.get_args(hint))
    name = getattr(hint, "__name__", str(hint))
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"
