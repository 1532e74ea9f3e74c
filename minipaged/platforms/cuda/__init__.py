"""The CUDA platform: the Triton kernels behind the attention contract, decode steps replayed
from CUDA graphs captured from the model's own forward, and the KV cache sized from the memory
left after the weights and a profile step.

* **Attention**: `triton_ops` (`minipaged.kernels`: the KV write, split-K decode, varlen
  prefill and block copy), imported on first use; with it, the model's RMSNorm (and the
  residual add before it) and SwiGLU activation swapped for one Triton launch each (`modules`).
* **Capture** (`CUDAPlatform.capture`): the forward run once to warm up (Triton compiles, the
  caching allocator settles), then again under `torch.cuda.graph` into one memory pool shared
  by every size; the runner replays it over its static buffers (`minipaged.runner.graphs`),
  for the ladder of batch sizes nano-vllm and vLLM use (1, 2, 4, 8, then every 16 up to
  `max_num_seqs`).
* **Memory** (`kv_cache_bytes`): vLLM's accounting: with the weights on the card, a forward of
  the largest step runs and its peak is measured, then one of the largest captured step (what
  its graph keeps in the pool); the cache gets `gpu_memory_utilization` of the card minus the
  weights, both peaks and what other than PyTorch's allocator holds (the CUDA context, other
  processes).
* **Device questions**: bfloat16 where the card multiplies it, vLLM's batch limits, NCCL's
  collectives with a card per tensor-parallel rank, pinned host memory for the copies.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from minipaged.attention.contract import AttentionOps
from minipaged.attention.reference import swap_blocks
from minipaged.models.layers import RMSNorm, SiluAndMul
from minipaged.models.tensor_parallel import TensorParallelError
from minipaged.platforms.base import CaptureUnsupported, Platform, Replay, swap_modules
from minipaged.platforms.cuda.modules import CUDARMSNorm, CUDASiluAndMul

__all__ = ["CUDAPlatform", "graph_ladder", "triton_ops"]


@functools.cache
def triton_ops() -> AttentionOps:
    """The Triton kernels as a backend ("triton"); swapping is a plain copy between devices."""
    kernels = importlib.import_module("minipaged.kernels")
    return AttentionOps(
        name="triton",
        paged_attention=kernels.paged_attention,
        reshape_and_cache=kernels.reshape_and_cache,
        copy_blocks=kernels.copy_blocks,
        swap_blocks=swap_blocks,
    )


def graph_ladder(max_num_seqs: int) -> tuple[int, ...]:
    """The decode batch sizes captured: 1, 2, 4, 8, then every multiple of 16 up to
    `max_num_seqs` (a step is padded to the next)."""
    sizes = [size for size in (1, 2, 4, 8) if size <= max_num_seqs]
    sizes += range(16, max_num_seqs + 1, 16)
    if sizes[-1] < max_num_seqs:
        sizes.append(max_num_seqs)
    return tuple(sizes)


class CUDAPlatform(Platform):
    """The Triton kernels, CUDA graphs and the profiled memory budget (module docstring)."""

    name = "cuda"
    attention_backend = "triton"
    defaults: ClassVar[dict[str, object]] = {
        "dtype": "auto", "max_num_seqs": 256, "max_num_batched_tokens": 8192}
    collective_backend = "nccl"
    pin_memory = True
    host_reads_free = False

    def __init__(self, device: torch.device, attention: AttentionOps | None = None, *,
                 capture: bool = True, max_num_seqs: int = 256) -> None:
        super().__init__(device, attention if attention is not None else triton_ops())
        self.graph_sizes = graph_ladder(max_num_seqs) if capture else ()
        self._pool = None

    @classmethod
    def check_and_update_config(cls, config: Any) -> None:
        """The base's settling, and a card for every tensor-parallel rank."""
        super().check_and_update_config(config)
        if 1 < config.tensor_parallel_size > torch.cuda.device_count():
            raise TensorParallelError(
                f"tensor_parallel_size {config.tensor_parallel_size} needs "
                f"{config.tensor_parallel_size} CUDA devices, {torch.cuda.device_count()} visible")

    @classmethod
    def native_bfloat16(cls) -> bool:
        return torch.cuda.is_bf16_supported()

    @classmethod
    def rank_device(cls, device: torch.device, index: int) -> torch.device:
        """Card `index`, made the current one."""
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    def load(self, model: nn.Module, quantization: str | None = None) -> nn.Module:
        """The model's norms and SwiGLU activations swapped for one-launch Triton modules
        (`modules`) where the attention is Triton's too."""
        if self.attention.name == "triton":
            swap_modules(model, {RMSNorm: CUDARMSNorm, SiluAndMul: CUDASiluAndMul})
        return model

    def capture(self, forward: Callable[[], Tensor]) -> tuple[Replay, Tensor]:
        """A CUDA graph of `forward`, after one warm-up run, replayed once so that its output
        holds the step in the buffers; all sizes share one pool."""
        try:
            forward()  # compiles the kernels; the allocator's blocks for this size exist after
            torch.cuda.synchronize(self.device)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = forward()
        except RuntimeError as error:  # an operator that syncs or is not capturable
            raise CaptureUnsupported(f"CUDA graph capture failed: {error}") from error
        graph.replay()  # a capture records the kernels without running them
        return graph.replay, out

    def kv_cache_bytes(self, profiles: Sequence[Callable[[], object]], config: Any) -> float:
        """`config.gpu_memory_utilization` of this rank's card, less what is allocated (the
        weights), less the sum of the peaks each of `profiles` adds (the largest step's
        activations, and those the largest captured step's graph keeps in its pool), and less
        the memory PyTorch's allocator does not hold."""
        torch.cuda.empty_cache()
        held = torch.cuda.memory_allocated(self.device)
        peaks = 0
        for profile in profiles:
            torch.cuda.reset_peak_memory_stats(self.device)
            profile()
            torch.cuda.synchronize(self.device)
            peaks += torch.cuda.max_memory_allocated(self.device) - held
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = total - free - torch.cuda.memory_reserved(self.device)
        return total * config.gpu_memory_utilization - held - peaks - max(0, outside_torch)
