"""The model families and how a model is built: `FAMILIES`, `build_model`, `load_model`.

A family is one module and one entry here. Its module declares it as a `FamilySpec`
(`minipaged.models.checkpoint.model_config`): the config.json model types and the GGUF architecture
it reads, its config quirks, its parameters' names and shapes, llama.cpp's conversions of it, the
class that runs it, its tensor-parallel splits. `FAMILIES` maps `ModelConfig.architecture` to it;
the checkpoint readers are given `FAMILIES` and the config they return carries its family. Two model
classes cover every family: `LlamaForCausalLM` (`minipaged.models.llama`: LLaMA, SmolLM2, Mistral,
Qwen2 / Qwen2.5, Qwen3) and `GPT2ForCausalLM` (`minipaged.models.gpt2`), built from the blocks of
`minipaged.models.layers`. Each runs on a flat token batch and attends through an
`AttentionBackend`, which owns the KV cache; the model never sees it.

`build_model` checks a Hugging Face-named state dict against the family's table
(`minipaged.models.checkpoint.weight_names.expected_shapes`, the one the checkpoint readers use) and
loads it by name.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import partial

import torch
from torch import Tensor

from minipaged.models.checkpoint.loader import load_checkpoint
from minipaged.models.checkpoint.model_config import FamilySpec, ModelConfig
from minipaged.models.checkpoint.weight_names import (
    CheckpointError,
    expected_shapes,
    is_transposed,
    mismatches,
    to_module_name,
)
from minipaged.models.gpt2 import GPT2
from minipaged.models.layers import CausalLM
from minipaged.models.llama import LLAMA, QWEN2, QWEN3
from minipaged.models.tensor_parallel import (
    SINGLE_RANK,
    TensorParallel,
    check_shardable,
    hf_state_dict,
    read_shard,
    shard_shapes,
)

__all__ = [
    "FAMILIES",
    "CheckpointMismatchError",
    "build_model",
    "load_model",
]

# `ModelConfig.architecture` -> its family, as its module declares it.
FAMILIES: dict[str, FamilySpec] = {f.architecture: f for f in (LLAMA, QWEN2, QWEN3, GPT2)}


class CheckpointMismatchError(CheckpointError):
    """A state dict does not match the model its config describes (missing, extra, mis-shaped)."""


def build_model(
    config: ModelConfig,
    state_dict: dict[str, Tensor],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tp: TensorParallel | None = None,
) -> CausalLM:
    """The model of `config.family` holding the weights of `state_dict`, in eval mode.

    `state_dict` uses Hugging Face's names, with or without the `model.` / `transformer.` prefix.
    A tied head (`tie_word_embeddings`) shares the embedding's tensor. Raises
    `CheckpointMismatchError` naming any missing, unexpected or mis-shaped tensor. With `tp`,
    the model is one tensor-parallel rank's shard and `state_dict` holds that rank's slices
    (`minipaged.models.tensor_parallel.shard_state_dict`, or `load_model(..., tp=...)`).
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
    tp = tp or SINGLE_RANK
    check_shardable(config, tp.world_size)
    weights = hf_state_dict(config, state_dict)
    expected = expected_shapes(config) if tp.world_size == 1 else shard_shapes(config, tp)
    _check_weights(config, weights, expected)
    # Build on the meta device (no memory, no random init), then adopt the checkpoint's tensors.
    with torch.device("meta"):
        model = config.family.model_class(config, tp)
    in_module_layout = {
        to_module_name(config, name): w.t() if is_transposed(config, name) else w
        for name, w in weights.items()
    }
    loaded = model.load_state_dict(
        {name: w.to(device=device, dtype=dtype) for name, w in in_module_layout.items()},
        strict=False,
        assign=True,
    )
    # The table and the modules name the same parameters: only a tied head is left to share.
    assert not loaded.unexpected_keys, loaded.unexpected_keys
    assert loaded.missing_keys == (["lm_head.weight"] if config.tie_word_embeddings else [])
    if config.tie_word_embeddings:
        model.lm_head.weight = model.input_embedding().weight
    return model.to(device).eval()  # the rotary tables are computed on the CPU


def load_model(
    path: str | os.PathLike[str] | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool = True,
    tp: TensorParallel | None = None,
    families: Mapping[str, FamilySpec] = FAMILIES,
) -> tuple[CausalLM, ModelConfig]:
    """Load a checkpoint (HF folder, safetensors or GGUF; default: the bundled SmolLM2) of one
    of `families`. With `tp`, load one tensor-parallel rank's shard, reading only its slices
    (`read_shard`). The model is the plain one: a platform makes it fast where it runs
    (`minipaged.platforms`)."""
    read = None if tp is None or tp.world_size == 1 else partial(read_shard, tp=tp)
    config, state_dict = load_checkpoint(
        path, families, dtype=torch.float32, progress=progress, read=read
    )
    return build_model(config, state_dict, dtype=dtype, device=device, tp=tp), config


def _check_weights(
    config: ModelConfig, weights: dict[str, Tensor], expected: dict[str, tuple[int, ...]]
) -> None:
    missing, wrong, unexpected = mismatches(
        config, {name: w.shape for name, w in weights.items()}, expected
    )
    wrong = [f"{n}: expected {expected[n]}, got {tuple(weights[n].shape)}" for n in wrong]
    kinds = {"missing": missing, "unexpected": unexpected, "wrong shape": wrong}
    problems = [f"{kind} {_abbrev(names)}" for kind, names in kinds.items() if names]
    if problems:
        raise CheckpointMismatchError("state dict does not fit the config: " + "; ".join(problems))


def _abbrev(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
