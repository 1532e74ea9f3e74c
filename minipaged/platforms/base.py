"""The platform seam: everything that makes the plain model fast on one kind of device, behind
one interface the model runner calls.

A `Platform` does four things, and the model's own code does none of them:

* **`load`**: swap the model's modules for its own subclasses where it has a faster kernel (and
  quantise, and lay the weights out), at load, as gpt-fast swaps its int8 linear layers in; the
  start-up choices it makes (which GEMM wins at how many rows) are made here, once, and logged.
* **`attention`**: its paged-attention operations, behind the attention contract
  (`minipaged.attention.contract.AttentionOps`).
* **`capture`**: turn one run of a step's forward over static buffers into something that
  replays it (a CUDA graph; on a CPU the recorded kernel calls), for the decode steps of the
  batch sizes `graph_sizes`; the runner owns the buffers and picks the steps
  (`minipaged.runner.graphs`).
* **`kv_cache_bytes`**: the memory the KV cache may take once the weights are in place and the
  largest step has run (vLLM's profile run).

`Platform` itself is the reference: the model as written, the PyTorch reference attention, no
capture, the configured KV cache size. `attention_backend="torch"` with `enforce_eager=True`
runs it on any device, with no platform code at all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor, nn

from minipaged.attention.contract import AttentionOps
from minipaged.attention.reference import REFERENCE_OPS

GiB = 1 << 30
logger = logging.getLogger("minipaged")

# A captured step: run it to have its forward's output buffer written again.
Replay = Callable[[], object]


class CaptureUnsupported(RuntimeError):
    """A platform cannot capture this forward (the runner then runs it through the modules)."""


class Platform:
    """The reference platform (module docstring); a device's platform subclasses it."""

    name = "reference"

    def __init__(self, device: torch.device, attention: AttentionOps = REFERENCE_OPS) -> None:
        self.device = device
        self.attention = attention
        self.graph_sizes: tuple[int, ...] = ()  # set by `load` where the platform captures

    def load(self, model: nn.Module, quantization: str | None = None) -> nn.Module:
        """`model`, on this platform's device, made fast here; the reference changes nothing
        and quantises nothing."""
        if quantization is not None:
            raise ValueError(f"quantization {quantization!r} needs a platform that has it (the "
                             f"CPU's), not the {self.name} platform")
        return model

    def capture(self, forward: Callable[[], Tensor]) -> tuple[Replay, Tensor]:
        """Run `forward` (a step over static buffers) and return what replays it and its output
        buffer, which holds the result of the step in the buffers now (it may run again: it
        writes the same K/V). Raises `CaptureUnsupported`; the reference captures nothing."""
        raise CaptureUnsupported(f"the {self.name} platform captures no steps")

    def kv_cache_bytes(self, profile: Callable[[], object], gpu_memory_utilization: float,
                       kv_cache_memory: float) -> float:
        """Bytes the KV cache may take: `kv_cache_memory` GiB (a CPU's host memory is not
        measured); a device platform measures what is left after `profile`."""
        return kv_cache_memory * GiB

    def greedy_tokens(self, logits: Tensor) -> tuple[Tensor, Tensor] | None:
        """Each row's argmax token of float32 logits `[B, V]` and its log-probability, where
        the platform has a faster way than the sampler's PyTorch; None: the sampler's way."""
        return None


def swap_modules(model: nn.Module, swaps: dict[type, type]) -> int:
    """Give every module of `model` whose type is a key of `swaps` (exactly: subclasses such as
    tensor-parallel layers keep theirs) the class its value names, in place: the same object,
    parameters and buffers (a tied weight stays tied, a module shared by several layers stays
    one). Returns how many modules changed class. A swap class adds behaviour, never state."""
    count = 0
    for module in model.modules():
        new = swaps.get(type(module))
        if new is not None:
            module.__class__ = new
            count += 1
    return count
