"""GGUF checkpoints (llama.cpp's single-file format): metadata in, HF-named tensors out.

Hyper-parameters live in the metadata (`llama.block_count`, `qwen3.attention.key_length`, ...)
and weights are usually block-quantised. The family is the one whose `gguf_architecture` is the
file's `general.architecture`; the keys every llama.cpp architecture has are read here, the
family's own (`FamilySpec.from_gguf`) by the family. Tensors are dequantised with the `gguf`
package and renamed to Hugging Face's names through the `gguf` package's own name table for that
architecture (the one llama.cpp's converter writes with), so the names a family needs are those
of its `shapes`, nothing listed twice. Two conversions of llama.cpp's converter are undone:

* For families with `gguf_permuted_qk` (LLaMA) it permutes the rows of the query and key
  projections (weights and biases): llama.cpp runs LLaMA with its interleaved rotary, which
  turns pairs (x0, x1), (x2, x3), ..., while Hugging Face's `rotate_half` turns x_j with
  x_{j + d/2}. Qwen2 and Qwen3 run with the NeoX rotary, which is `rotate_half`, and are stored
  unpermuted.
* It stores the weights a family keeps `(in, out)` (GPT-2's `Conv1D`) transposed, `(out, in)`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minipaged.models.checkpoint.model_config import FamilySpec, ModelConfig, check_token_ids
from minipaged.models.checkpoint.weight_names import (
    CheckpointError,
    PendingTensor,
    check_layer_count,
    expected_shapes,
    is_transposed,
)
from minipaged.tokenizer.gguf_file import (
    GGMLQuantizationType,
    GGUFError,
    GGUFFile,
    GGUFTensor,
    read_gguf_file,
)

# Rows of blocks joined to about this many bytes for `gguf.quants.dequantize` (below): it takes
# 16 rows a step, whose float32 values then stay within a core's L2 (16 KiB rows: 10% slower,
# 64 KiB: 75%).
JOINED_ROW_BYTES = 1 << 12

_MISSING = object()


class GGUFMetadata:
    """Typed access to a GGUF file's key/value metadata, with errors that name the file; what a
    family's `from_gguf` reads."""

    def __init__(self, gguf_file: GGUFFile) -> None:
        self.values, self.file = gguf_file.metadata, gguf_file.path
        self.architecture = self.get("general.architecture")
        self.tensor_names = frozenset(t.name for t in gguf_file.tensors)

    def get(self, key: str, default: Any = _MISSING) -> Any:
        value = self.values.get(key, default)
        if value is _MISSING:
            raise CheckpointError(f"{self.file}: GGUF metadata key {key!r} missing")
        return value

    def arch_get(self, key: str, default: Any = _MISSING) -> Any:
        """The architecture's own `key` (`arch_get("block_count")`: `llama.block_count`)."""
        return self.get(f"{self.architecture}.{key}", default)


def config_from_gguf(
    source: str | Path | GGUFFile, families: Mapping[str, FamilySpec]
) -> ModelConfig:
    """A `ModelConfig` from a GGUF file's metadata, as the one of `families` whose
    `gguf_architecture` the file names; `source` is a path or a read `GGUFFile`.

    The head is tied to the token embedding exactly when the file has no `output.weight`.
    """
    gguf_file = source if isinstance(source, GGUFFile) else open_gguf(Path(source))
    file, meta = gguf_file.path, GGUFMetadata(gguf_file)
    arch = meta.architecture
    family = next((f for f in families.values() if f.gguf_architecture == arch), None)
    if family is None or family.from_gguf is None:
        known = [f.gguf_architecture for f in families.values() if f.gguf_architecture]
        raise CheckpointError(
            f"{file}: unsupported architecture {arch!r} (general.architecture); minipaged "
            f"loads GGUF files of {', '.join(known)}"
        )
    tokens = gguf_file.metadata.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens) if tokens is not None else meta.arch_get("vocab_size")
    special = {
        name: meta.get(f"tokenizer.ggml.{name}", None)
        for name in ("bos_token_id", "eos_token_id", "padding_token_id")
    }
    try:
        check_token_ids(vocab_size, [(f"tokenizer.ggml.{k}", v) for k, v in special.items()])
        own = family.from_gguf(meta)
    except CheckpointError:
        raise
    except ValueError as exc:
        raise CheckpointError(f"{file}: {exc}") from exc
    except TypeError as exc:
        raise CheckpointError(f"{file}: inconsistent GGUF metadata ({exc})") from exc
    try:
        return ModelConfig(
            family=family,
            vocab_size=vocab_size,
            hidden_size=meta.arch_get("embedding_length"),
            num_layers=meta.arch_get("block_count"),
            num_heads=meta.arch_get("attention.head_count"),
            intermediate_size=meta.arch_get("feed_forward_length"),
            tie_word_embeddings="output.weight" not in meta.tensor_names,
            bos_token_id=special["bos_token_id"],
            eos_token_ids=() if special["eos_token_id"] is None else (special["eos_token_id"],),
            pad_token_id=special["padding_token_id"],
            **own,
        )
    except (TypeError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{file}: inconsistent GGUF metadata ({exc})") from exc


def open_gguf(file: Path) -> GGUFFile:
    """A GGUF file's header, read, and its tensors mapped; every failure a `CheckpointError`."""
    if not file.is_file():
        raise CheckpointError(f"{file} missing: no such file")
    try:
        return read_gguf_file(file)
    except GGUFError as exc:
        raise CheckpointError(f"{file}: {exc}") from exc


def gguf_checkpoint(
    file: Path, families: Mapping[str, FamilySpec]
) -> tuple[ModelConfig, dict[str, PendingTensor]]:
    """The config of a GGUF file and each of its tensors under its Hugging Face name."""
    gguf_file = open_gguf(file)
    config = config_from_gguf(gguf_file, families)
    check_layer_count(config, len(gguf_file.tensors), f"{file}: {config.architecture}.block_count")
    names = _hf_names(config)
    pending: dict[str, PendingTensor] = {}
    for tensor in gguf_file.tensors:
        if tensor.name not in names:
            raise CheckpointError(
                f"unexpected tensor {tensor.name} in {file}: minipaged's {config.architecture} "
                f"with this config has no such parameter"
            )
        name = names[tensor.name]
        # GGUF stores (out, in); a family that keeps (in, out) gets it back that way.
        shape = tensor.shape[::-1] if is_transposed(config, name) else tensor.shape
        read, read_part = _reader_fn(tensor, name, config, file)
        pending[name] = PendingTensor(shape, read, tensor.name, read_part)
    return config, pending


def _hf_names(config: ModelConfig) -> dict[str, str]:
    """llama.cpp's name -> Hugging Face's, for every tensor the family needs."""
    import gguf  # imported here: only this format needs it

    gguf_arch = config.family.gguf_architecture
    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == gguf_arch), None)
    if arch is None:
        raise CheckpointError(f"the gguf package has no tensor names for {gguf_arch!r}")
    table = gguf.get_tensor_name_map(arch, config.num_layers)
    names = {}
    for hf_name in expected_shapes(config):
        base, suffix = hf_name.rsplit(".", 1)
        gguf_base = table.get_name(base)
        if gguf_base is not None:
            names[f"{gguf_base}.{suffix}"] = hf_name
    return names


def _reader_fn(
    tensor: GGUFTensor, name: str, config: ModelConfig, file: Path
) -> tuple[Callable[[], torch.Tensor], Callable[[tuple[slice, ...]], torch.Tensor]]:
    """Functions that dequantise one GGUF tensor into its Hugging Face form: all of it, and a
    part of it (`PendingTensor.read_part`). A part made of whole rows dequantises only those
    rows (quantisation blocks run along a row); any other part is cut from the whole tensor."""

    def rows(which: slice) -> torch.Tensor:
        try:
            array = dequantize_rows(tensor.data[which], tensor.tensor_type)
        except NotImplementedError as exc:
            raise CheckpointError(
                f"{file}: tensor {tensor.name} has type {tensor.tensor_type.name}, which the "
                f"gguf package cannot dequantise ({exc})"
            ) from exc
        array = np.asarray(array, dtype=np.float32)
        qk = ".self_attn.q_proj." in name or ".self_attn.k_proj." in name
        if config.family.gguf_permuted_qk and qk:
            array = unpermute_qk(array, array.shape[0] // config.head_dim)  # whole heads
        elif is_transposed(config, name):
            array = array.T
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array, order="C")  # own the memory: the file is memory-mapped
        return torch.from_numpy(array)

    def read() -> torch.Tensor:
        return rows(slice(None))

    def read_part(index: tuple[slice, ...]) -> torch.Tensor:
        if is_transposed(config, name) or any(s != slice(None) for s in index[1:]):
            return read()[index]
        return rows(index[0])

    return read, read_part


def dequantize_rows(data: np.ndarray, tensor_type: GGMLQuantizationType) -> np.ndarray:
    """`gguf.quants.dequantize` of a tensor's rows, given to it joined into longer rows.

    It works through a tensor 16 rows at a time in Python, which for rows of a few hundred bytes
    costs more than the arithmetic. Quantisation blocks never cross a row, so joined rows
    dequantise to the same values in fewer, larger steps: SmolLM2's tensors in 0.50 s instead
    of 0.86-1.45 s."""
    from gguf.quants import dequantize  # imported here: only this format needs it

    if data.ndim != 2 or data.dtype != np.uint8:  # plain types: a view or a cast, no loop
        return dequantize(data, tensor_type)
    n_rows, row_bytes = data.shape
    join = max(1, min(n_rows, JOINED_ROW_BYTES // row_bytes))
    while n_rows % join:
        join -= 1
    joined = data.reshape(n_rows // join, join * row_bytes)
    return dequantize(joined, tensor_type).reshape(n_rows, -1)


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a query or key projection (`n_head` of its heads):
    a weight `[rows, cols]` or a bias `[rows]`.

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3), ... of each head; Hugging Face rotates
    x_j with x_{j + d/2}. Its converter therefore reorders each head's rows from
    [first half | second half] to interleaved [h0, s0, h1, s1, ...]; this puts them back.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head) != 0:
        raise ValueError(f"{rows} rows cannot be split into {n_head} heads of even size")
    pairs = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])  # head, pair, member
    return pairs.swapaxes(1, 2).reshape(weight.shape)  # head, member, pair: halves again
