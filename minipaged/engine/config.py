"""`EngineConfig`: everything an engine is built from besides the model, checked at once.

`SCHEDULERS` names the schedulers `EngineConfig.scheduler` may choose ("fcfs", "mlfq" and the
MLFQ ablations); `DTYPES` the model dtypes, which `DTYPE_CHOICES` extends by "auto" (bfloat16
where the device multiplies it natively, `native_bfloat16`; float32 elsewhere). The engine itself
is `minipaged.engine.engine`.

The default is exact float32. What bfloat16 changes: weights, activations and the KV cache are
stored with an 8-bit mantissa (about 3 significant digits), so logits move by about 1e-2 and a
greedy choice between two tokens whose logits are that close can flip; from there on the
continuations differ. The norms, the softmax of the attention and the logits are still computed
in float32 (docs/benchmarks.md, "CPU performance", measures the speed and the token agreement).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from minipaged.platforms.cpu.quantization import QUANTIZATIONS
from minipaged.runner.backends import BACKENDS
from minipaged.sampling.params import MAX_SEED, is_finite, shown
from minipaged.sched.cost_model import CostModel
from minipaged.sched.mlfq import MLFQConfig
from minipaged.sched.output import PreemptionMode
from minipaged.sched.registry import SCHEDULERS, check_preemption_mode, needs_cost_model

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
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


# The x86 CPU flags (Linux's /proc/cpuinfo names) of instructions that multiply bfloat16.
BFLOAT16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def native_bfloat16(device: torch.device) -> bool:
    """Whether `device` multiplies bfloat16 in hardware: a CUDA GPU that supports it, or a CPU
    with AMX-BF16 or AVX-512 BF16 (elsewhere bfloat16 is emulated and slower than float32). The
    CPU's flags are read from /proc/cpuinfo; without one (not Linux) the answer is no."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bool(cpu_flags() & BFLOAT16_CPU_FLAGS)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    return frozenset()


# -- configuration --------------------------------------------------------------------------------

# What a setting left at None becomes on each kind of device: a CPU keeps its exact float32 and
# the batch a few cores serve; a GPU takes bfloat16 where the card has it and vLLM's batch limits.
DEVICE_DEFAULTS: dict[str, dict[str, object]] = {
    "cpu": {"dtype": "float32", "max_num_seqs": 64, "max_num_batched_tokens": 2048},
    "cuda": {"dtype": "auto", "max_num_seqs": 256, "max_num_batched_tokens": 8192},
}


@dataclass
class EngineConfig:
    """Everything `LLM(...)` / `LLMEngine.from_pretrained(...)` accepts besides the model path.

    `num_gpu_blocks` and `num_cpu_blocks` are vLLM's names for the two pools of KV blocks:
    the GPU pool (the device's KV cache) and the CPU pool (the host's swap space), as the KV
    cache manager and the model runner call them.
    """

    dtype: str | None = None  # or "float32", "bfloat16", "float16", "auto" (DEVICE_DEFAULTS)
    device: str | None = None  # None: "cuda" when available, else "cpu"
    block_size: int = 16
    num_gpu_blocks: int | None = None  # None: from kv_cache_memory / gpu_memory_utilization
    kv_cache_memory: float = 1.0  # GiB of KV cache on a CPU device
    gpu_memory_utilization: float = 0.9  # fraction of a CUDA device's memory for model + cache
    swap_space: float = 1.0  # GiB of host memory for the CPU pool (swapped-out blocks)
    num_cpu_blocks: int | None = None  # None: from swap_space
    max_num_seqs: int | None = None  # None: the device's (DEVICE_DEFAULTS)
    max_num_batched_tokens: int | None = None  # None: the device's (DEVICE_DEFAULTS)
    max_model_len: int | None = None  # None: the model's own context length
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
    attention_backend: str | None = None  # None: Triton on CUDA; on a CPU "cpu" for 16 bits
    quantization: str | None = None  # "int8": weight-only int8 at load (a CPU, one rank)
    # True: every step through the model's modules, never a replayed decode step
    # (`minipaged.platforms.cpu.replay`; vLLM's flag of the same name turns off CUDA graphs).
    enforce_eager: bool = False
    seed: int = 0  # the engine's generator, for requests without a seed of their own
    # Tensor parallelism: ranks (worker processes) the model is split over, and how long a
    # collective waits for a rank before the run is declared dead
    # (`minipaged.runner.parallel.runner`).
    tensor_parallel_size: int = 1
    tensor_parallel_timeout: float = 60.0

    def __post_init__(self) -> None:
        check_field_types(self)
        self._check_ranges()
        defaults = DEVICE_DEFAULTS.get(self.torch_device.type, DEVICE_DEFAULTS["cpu"])
        for name, value in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        check_choice("dtype", self.dtype, sorted(DTYPE_CHOICES))
        check_choice("scheduler", self.scheduler, sorted(SCHEDULERS))
        if self.mlfq is not None and not needs_cost_model(self.scheduler):
            raise ValueError(f"mlfq settings need an MLFQ scheduler, got {self.scheduler!r}")
        check_choice("quantization", self.quantization, QUANTIZATIONS, None)
        one_cpu_rank = self.tensor_parallel_size == 1 and self.torch_device.type == "cpu"
        if self.quantization is not None and not one_cpu_rank:
            raise ValueError("quantization 'int8' runs on a CPU on one rank: "
                             "tensor_parallel_size must be 1 and the device cpu")

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
        if self.scheduler in SCHEDULERS:
            check_preemption_mode(self.scheduler, self.preemption_mode)
        check_choice("attention_backend", self.attention_backend, list(BACKENDS), None, "auto")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The model's dtype; "auto" resolved for `torch_device`."""
        if self.dtype in ("auto", None):
            return torch.bfloat16 if native_bfloat16(self.torch_device) else torch.float32
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")


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
