"""Layer 2 -- checkpoints: Hugging Face safetensors folders and GGUF files become one
`ModelConfig` and a state dict with Hugging Face's tensor names.
"""

from __future__ import annotations

from minipaged.checkpoint.loader import checkpoint_config, default_model_path, load_checkpoint
from minipaged.checkpoint.model_config import ModelConfig
from minipaged.checkpoint.weight_names import CheckpointError

__all__ = [
    "CheckpointError",
    "ModelConfig",
    "checkpoint_config",
    "default_model_path",
    "load_checkpoint",
]
