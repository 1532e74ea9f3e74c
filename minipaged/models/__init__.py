"""Layer 3 -- the models, written out in PyTorch over a flat batch of tokens: LLaMA and its
family (Mistral, Qwen2, Qwen3) and GPT-2, their shared layers, and the tensor-parallel layers.
Each family's module declares it (a `FamilySpec`); `FAMILIES` is the registry of them.
"""

from __future__ import annotations

from minipaged.models.layers import AttentionBackend, CausalLM, ModelInputError
from minipaged.models.registry import FAMILIES, CheckpointMismatchError, build_model, load_model
from minipaged.models.tensor_parallel import TensorParallel, TensorParallelError

__all__ = [
    "FAMILIES",
    "AttentionBackend",
    "CausalLM",
    "CheckpointMismatchError",
    "ModelInputError",
    "TensorParallel",
    "TensorParallelError",
    "build_model",
    "load_model",
]
