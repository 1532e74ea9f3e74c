"""Layer 2 -- checkpoints: Hugging Face safetensors folders and GGUF files become one
`ModelConfig` and a state dict with Hugging Face's tensor names, for the model families they are
given (each a `FamilySpec`, declared by its module in `minipaged.models`).
"""

from __future__ import annotations

from minipaged.models.checkpoint.loader import (
    checkpoint_config,
    default_model_path,
    load_checkpoint,
)
from minipaged.models.checkpoint.model_config import FamilySpec, ModelConfig
from minipaged.models.checkpoint.weight_names import CheckpointError

__all__ = [
    "CheckpointError",
    "FamilySpec",
    "ModelConfig",
    "checkpoint_config",
    "default_model_path",
    "load_checkpoint",
]
