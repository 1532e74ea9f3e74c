"""The platform seam: everything that makes the plain model fast on one kind of device, behind
one interface the model runner calls.

A `Platform` answers every question that depends on the device, and the model's own code
asks none of them:

* **`check_and_update_config`** (vLLM's idea): looks at a runner's settings once, before
  anything is built, and settles them: the device's defaults (`defaults`), "auto" dtypes (native
  bfloat16 or not), the attention backend, the quantizations it offers and their rules, whether
  tensor parallelism has its collectives (`collective_backend`) and devices. It also knows a
  rank's device and torch threads, and whether host memory for the device is pinned.
* **`load`**: swap the model's modules for its own subclasses where it has a faster kernel (and
  quantise, and lay the weights out), at load, as gpt-fast swaps its int8 linear layers in; the
  start-up choices it makes (which GEMM wins at how many rows) are made here, once, and logged.
* **`attention`**: its paged-attention operations, behind the attention contract
  (`minipaged.attention.contract.AttentionOps`).
* **`capture`**: turn one run of a step's forward over static buffers into something that
  replays it (a CUDA graph; on a CPU the recorded kernel calls), for the decode steps of the
  batch sizes `graph_sizes`; the runner owns the buffers and picks the steps
  (`minipaged.runner.graphs`); `capture_key` names what else a capture is bound to (the CPU's:
  its thread count).
* **`kv_cache_bytes`**: the memory the KV cache may take once the weights are in place and the
  largest step (and the largest captured one) has run (vLLM's profile run), on one rank or on
  each tensor-parallel rank alike.

`Platform` itself is the reference: the model as written, the PyTorch reference attention, no
capture, the configured KV cache size. `attention_backend="torch"` with `enforce_eager=True`
runs it on any device, with no platform code at all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from minipaged.attention.contract import AttentionOps
from minipaged.attention.reference import REFERENCE_OPS
from minipaged.models.tensor_parallel import TensorParallelError

GiB = 1 << 30
logger = logging.getLogger("minipaged")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
QUANTIZATIONS = ("int8",)  # what some platform offers (the CPU's `quantizations`)

# A captured step: run it to have its forward's output buffer written again.
Replay = Callable[[], object]


class CaptureUnsupported(RuntimeError):
    """A platform cannot capture this forward (the runner then runs it through the modules)."""


class Platform:
    """The reference platform (module docstring); a device's platform subclasses it. The class
    holds the device's facts, an instance the state of one runner's platform."""

    name = "reference"
    attention_backend = "torch"  # the backend a config that names none gets
    # What a setting left at None becomes: a CPU keeps its exact float32 and the batch a few
    # cores serve; a GPU takes bfloat16 where the card has it and vLLM's batch limits.
    defaults: ClassVar[dict[str, object]] = {
        "dtype": "float32", "max_num_seqs": 64, "max_num_batched_tokens": 2048}
    quantizations: tuple[str, ...] = ()
    collective_backend: str | None = None  # torch.distributed's, for tensor parallelism
    rank_threads: int | None = None  # torch threads of a tensor-parallel rank (None: torch's)
    pin_memory = False  # host memory copied to the device is pinned (a GPU: faster copies)
    # The host reads a value of the device's tensors without waiting for queued work (a CPU's
    # are the host's own); a GPU's sampler then reads nothing but the sampled tokens.
    host_reads_free = True

    def __init__(self, device: torch.device, attention: AttentionOps = REFERENCE_OPS, *,
                 capture: bool = True, max_num_seqs: int = 256) -> None:
        """The platform of `device` with `attention`; where a platform captures decode steps,
        `capture` lets it, up to `max_num_seqs` sequences (the reference captures none)."""
        self.device = device
        self.attention = attention
        self.graph_sizes: tuple[int, ...] = ()  # the decode sizes captured (none here)

    @classmethod
    def check_and_update_config(cls, config: Any) -> None:
        """Settle a `RunnerConfig`'s device questions (`minipaged.runner.config`), once, before
        anything is built: defaults for what is None, "auto" dtypes and backends resolved, a
        quantization or a tensor-parallel size this device cannot run refused (`ValueError`)."""
        for name, value in cls.defaults.items():
            if getattr(config, name) is None:
                setattr(config, name, value)
        if config.dtype == "auto":
            config.dtype = "bfloat16" if cls.native_bfloat16() else "float32"
        if config.attention_backend in (None, "auto"):
            config.attention_backend = cls.attention_backend
        if config.quantization not in (None, *cls.quantizations):
            raise ValueError(f"quantization {config.quantization!r} needs a platform that has it "
                             f"(the CPU's), not the {cls.name} platform")
        backend = cls.collective_backend
        if config.tensor_parallel_size > 1 and (backend is None or not dist.is_available()
                                                or not dist.is_backend_available(backend)):
            raise TensorParallelError(
                f"tensor parallelism on {cls.name} needs the {backend} backend of "
                f"torch.distributed" if backend else
                f"tensor parallelism runs on cpu or cuda, not on the {cls.name} platform")

    @classmethod
    def native_bfloat16(cls) -> bool:
        """Whether the device multiplies bfloat16 in hardware (elsewhere it is emulated and
        slower than float32): "auto" dtypes take it where it does."""
        return False

    @classmethod
    def rank_device(cls, device: torch.device, index: int) -> torch.device:
        """The device of tensor-parallel rank `index` on its machine, made current."""
        return device

    def capture_key(self) -> object:
        """What a captured step is bound to besides its size (the runner keeps one capture
        per size and key); None: nothing."""
        return None

    def load(self, model: nn.Module, quantization: str | None = None) -> nn.Module:
        """`model`, on this platform's device, made fast here (`quantization`: one of
        `quantizations`, checked by `check_and_update_config`); the reference changes nothing."""
        return model

    def capture(self, forward: Callable[[], Tensor]) -> tuple[Replay, Tensor]:
        """Run `forward` (a step over static buffers) and return what replays it and its output
        buffer, which holds the result of the step in the buffers now (it may run again: it
        writes the same K/V). Raises `CaptureUnsupported`; the reference captures nothing."""
        raise CaptureUnsupported(f"the {self.name} platform captures no steps")

    def kv_cache_bytes(self, profiles: Sequence[Callable[[], object]], config: Any) -> float:
        """Bytes this rank's KV cache may take, called once the weights are placed:
        `config.kv_cache_memory` GiB shared by the ranks (a CPU's host memory is not measured);
        a device platform measures what is left after `profiles` (forwards whose peaks the
        runner will hold at once: a step's activations, a capture's memory)."""
        return config.kv_cache_memory * GiB / config.tensor_parallel_size

    def greedy_tokens(self, logits: Tensor) -> tuple[Tensor, Tensor] | None:
        """Each row's argmax token of float32 logits `[B, V]` and its log-probability, where
        the platform has a faster way than the sampler's PyTorch; None: the sampler's way."""
        return None


def swap_modules(model: nn.Module, swaps: dict[type, type]) -> int:
    """Give every module of `model` whose type is a key of `swaps` (exactly: subclasses such as
    tensor-parallel layers keep theirs) the class its value names, in place: the same object,
    parameters and buffers (a tied weight stays tied, a module shared by several layers stays
    one). Returns how many modules changed class. A swap class adds behaviour and at most
    settings with class defaults (a `CPULinear`'s few-row path); a module that holds other
    state (an `Int8Linear`'s int8 weight) is built by its constructor and put in with
    `set_submodule`."""
    count = 0
    for module in model.modules():
        new = swaps.get(type(module))
        if new is not None:
            module.__class__ = new
            count += 1
    return count
