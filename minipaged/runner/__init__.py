"""Layer 10 -- the model runner: it owns the tensors (the device KV cache, the host pool, the
flat batch), runs a step's plan through the model and returns logits; it decides nothing.
"""

from __future__ import annotations

from minipaged.runner.config import RunnerConfig
from minipaged.runner.model_runner import ModelRunner
from minipaged.runner.profiler import profile_runner

__all__ = [
    "ModelRunner",
    "RunnerConfig",
    "profile_runner",
]
