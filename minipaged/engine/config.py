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

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from minipaged.models.quantization import QUANTIZATIONS
from minipaged.sched.cost_model import CostModel
from minipaged.sched.mlfq import MLFQConfig
from minipaged.sched.registry import SCHEDULERS, needs_cost_model

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_CHOICES = (*DTYPES, "auto")


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
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


# -- configuration --------------------------------------------------------------------------------


@dataclass
class EngineConfig:
    """Everything `LLM(...)` / `LLMEngine.from_pretrained(...)` accepts besides the model path.

    `num_gpu_blocks` and `num_cpu_blocks` are vLLM's names for the device and host pools of KV
    blocks (`KVCacheManager`'s `num_gpu_blocks` and `num_cpu_blocks`).
    """

    dtype: str = "float32"  # or "bfloat16", "float16", "auto" (bfloat16 where native)
    device: str | None = None  # None: "cuda" when available, else "cpu"
    block_size: int = 16
    num_gpu_blocks: int | None = None  # None: from kv_cache_memory / gpu_memory_utilization
    kv_cache_memory: float = 1.0  # GiB of KV cache on a CPU device
    gpu_memory_utilization: float = 0.9  # fraction of a CUDA device's memory for model + cache
    swap_space: float = 1.0  # GiB of host memory for swapped-out blocks
    num_cpu_blocks: int | None = None  # None: from swap_space
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's own context length
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduler: str = "fcfs"
    # MLFQ schedulers: settings replacing the variant's (`MLFQConfig`), and a ready cost model
    # (`CostModel`) or a JSON file of one (`CostModel.save`) so that the engine need not profile
    # this model at start-up. A file that does not exist yet is written with the profile taken.
    mlfq: MLFQConfig | None = None
    cost_model: CostModel | None = None
    cost_model_file: str | Path | None = None
    preemption_mode: str | None = None  # None: recompute single sequences, swap groups
    attention_backend: str | None = None  # None: Triton on CUDA; on a CPU "cpu" for 16 bits
    quantization: str | None = None  # "int8": weight-only int8 at load (a CPU, one rank)
    seed: int = 0  # the engine's generator, for requests without a seed of their own
    # Tensor parallelism: ranks (worker processes) the model is split over, and how long a
    # collective waits for a rank before the run is declared dead (`minipaged.parallel.runner`).
    tensor_parallel_size: int = 1
    tensor_parallel_timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(
                f"scheduler must be one of {sorted(SCHEDULERS)}, got {self.scheduler!r}"
            )
        if self.mlfq is not None and not needs_cost_model(self.scheduler):
            raise ValueError(f"mlfq settings need an MLFQ scheduler, got {self.scheduler!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.num_cpu_blocks is not None and self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(
                f"max_model_len must be None or >= 2 (a prompt token and one to generate), "
                f"got {self.max_model_len}"
            )
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(
            self.tensor_parallel_size, int
        ) or self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}"
            )
        if not self.tensor_parallel_timeout > 0:
            raise ValueError(
                f"tensor_parallel_timeout must be > 0 seconds, got {self.tensor_parallel_timeout}"
            )
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}")
        if self.quantization is not None:
            if self.quantization not in QUANTIZATIONS:
                raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got "
                                 f"{self.quantization!r}")
            if self.tensor_parallel_size > 1 or self.torch_device.type != "cpu":
                raise ValueError("quantization 'int8' runs on a CPU on one rank: "
                                 "tensor_parallel_size must be 1 and the device cpu")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The model's dtype; "auto" resolved for `torch_device`."""
        if self.dtype == "auto":
            return torch.bfloat16 if native_bfloat16(self.torch_device) else torch.float32
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
