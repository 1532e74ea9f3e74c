"""`RunnerConfig`: what a model runner and its platform are built from, settled once.

Its fields are the device side of `EngineConfig` (which extends it with the scheduler's): the
device and dtype, the KV cache's blocks and memory, the batch limits the memory profile runs,
the attention backend, quantization, eager steps and tensor parallelism. Each default is
written here once. A field the device decides is settled at construction by the device's
platform (`Platform.check_and_update_config`: its defaults for what is None, "auto" resolved,
what the device cannot run refused); the engine, the runner builder and the runner read the
settled object.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minipaged.platforms import DTYPES, default_device, platform_class


@dataclass
class RunnerConfig:
    """A runner's settings (module docstring). `num_gpu_blocks` and `num_cpu_blocks` are vLLM's
    names for the device's KV cache and the host's swap pool, in blocks."""

    dtype: str | None = None  # or "float32", "bfloat16", "float16", "auto": the platform's
    device: str | None = None  # None: "cuda" when available, else "cpu"
    block_size: int = 16
    num_gpu_blocks: int | None = None  # None: what the platform grants once the weights are placed
    kv_cache_memory: float = 1.0  # GiB of KV cache on a CPU device (the ranks' together)
    gpu_memory_utilization: float = 0.9  # fraction of a CUDA device's memory for model + cache
    swap_space: float = 1.0  # GiB of host memory for the CPU pool (swapped-out blocks)
    num_cpu_blocks: int | None = None  # None: from swap_space
    max_num_seqs: int | None = None  # None: the platform's
    max_num_batched_tokens: int | None = None  # None: the platform's
    max_model_len: int | None = None  # None: the model's own context length
    attention_backend: str | None = None  # None: the platform's (Triton on CUDA, "cpu" on a CPU)
    quantization: str | None = None  # "int8": weight-only int8 at load (a CPU, one rank)
    # True: every step through the model's modules, never a replayed decode step
    # (`minipaged.platforms.cpu.replay`; vLLM's flag of the same name turns off CUDA graphs).
    enforce_eager: bool = False
    # Tensor parallelism: ranks (worker processes) the model is split over, and how long a
    # collective waits for a rank before the run is declared dead
    # (`minipaged.runner.parallel.runner`).
    tensor_parallel_size: int = 1
    tensor_parallel_timeout: float = 60.0

    def __post_init__(self) -> None:
        self.device = self.device or default_device()
        platform_class(self.device).check_and_update_config(self)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)
