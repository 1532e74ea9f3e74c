"""Layer 11 -- tensor parallelism on `torch.distributed`: the worker ranks and rank 0's
runner, which sends every rank the same plan (Megatron-LM's column and row splits live with the
models, in `minipaged.models.tensor_parallel`).
"""

from __future__ import annotations

from minipaged.runner.parallel.runner import TensorParallelRunner, WorkerDiedError, build_runner
from minipaged.runner.parallel.worker import CheckpointShards, ShardSource

__all__ = [
    "CheckpointShards",
    "ShardSource",
    "TensorParallelRunner",
    "WorkerDiedError",
    "build_runner",
]
