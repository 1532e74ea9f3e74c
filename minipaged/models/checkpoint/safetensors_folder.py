"""Hugging Face safetensors checkpoints: a folder with `config.json` and one `model.safetensors`
or shards listed in `model.safetensors.index.json`, or one `.safetensors` file next to a
`config.json`.

Tensor names are already Hugging Face's and the hyper-parameters are in `config.json`, so the
work here is finding the files, reading their headers strictly enough that a cut-off or foreign
file fails clearly, and describing each tensor (`PendingTensor`) for the checks of
`minipaged.models.checkpoint.weight_names` before any data is read.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from minipaged.models.checkpoint.model_config import FamilySpec, ModelConfig
from minipaged.models.checkpoint.weight_names import (
    CheckpointError,
    PendingTensor,
    expected_shapes,
    full_name,
    is_ignored,
)

SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_folder(folder: Path) -> tuple[Path, list[Path]]:
    """The config.json and the safetensors files of a Hugging Face model folder."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{config_file} missing: {folder} is not a Hugging Face model folder")
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
        files = [folder / shard for shard in shards]
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{file} missing: listed in {index}")
        return config_file, files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors file next to config.json")
    if len(files) > 1:
        raise CheckpointError(
            f"{folder}: {len(files)} safetensors files but no {SAFETENSORS_INDEX} saying "
            f"which belong to the model"
        )
    return config_file, files


def read_config_json(config_file: Path, families: Mapping[str, FamilySpec]) -> ModelConfig:
    """The `ModelConfig` of a config.json, as one of `families`; any problem is a
    `CheckpointError` naming the file."""
    try:
        return ModelConfig.from_json_file(config_file, families)
    except ValueError as exc:  # from_json_file words its errors; name the file once
        message = str(exc)
        raise CheckpointError(
            message if str(config_file) in message else f"{config_file}: {message}"
        ) from exc


def safetensors_tensors(file: Path, config: ModelConfig) -> dict[str, PendingTensor]:
    """Every tensor of `file` under its full Hugging Face name, ready to be checked and read."""
    from safetensors import safe_open  # imported here: only this format needs it

    header = _safetensors_header(file)
    try:
        handle = safe_open(str(file), framework="pt")  # memory-mapped, read lazily below
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(f"{file}: corrupt safetensors file ({exc})") from exc
    expected = expected_shapes(config)
    pending: dict[str, PendingTensor] = {}
    for stored, info in header.items():
        name = full_name(config, stored, expected)
        if is_ignored(config, name):
            continue

        def read(stored: str = stored) -> torch.Tensor:
            return handle.get_tensor(stored)

        def read_part(index: tuple[slice, ...], stored: str = stored) -> torch.Tensor:
            return handle.get_slice(stored)[index]  # only these bytes leave the mapped file

        pending[name] = PendingTensor(tuple(info["shape"]), read, stored, read_part)
    return pending


def count_safetensors_tensors(file: Path) -> int:
    """How many tensors `file`'s header lists (the header checked, no data read)."""
    return len(_safetensors_header(file))


def _safetensors_header(file: Path) -> dict[str, Any]:
    """Parse and check a safetensors header, so a cut-off or foreign file fails clearly: each
    tensor's name -> its dtype, shape and data offsets (the free-form `__metadata__` left out)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise CheckpointError(f"{file}: truncated safetensors file ({size} bytes)")
        (header_len,) = struct.unpack("<Q", raw_len)
        if 8 + header_len > size:
            raise CheckpointError(
                f"{file}: truncated safetensors file (header of {header_len} bytes announced, "
                f"file has {size} bytes)"
            )
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{file}: not a safetensors file (bad header: {exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: not a safetensors file (header is not a JSON object)")
    header.pop("__metadata__", None)
    data_len = max((info["data_offsets"][1] for info in header.values()), default=0)
    if 8 + header_len + data_len > size:
        raise CheckpointError(
            f"{file}: truncated safetensors file (tensor data needs {data_len} bytes after the "
            f"header, the file has {size - 8 - header_len})"
        )
    return header
