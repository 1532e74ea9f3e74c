"""GGUF's container, read directly: the metadata as Python values, each tensor as a view of the
memory-mapped file.

A GGUF file (llama.cpp's single-file format; ggml's `docs/gguf.md`) is a header -- the magic
``GGUF``, a version, the tensor and key/value counts -- then typed key/value metadata, one
record per tensor (name, dimensions, type, offset), and the tensor data, aligned to
`general.alignment` (32 bytes unless the metadata says otherwise). Everything is little-endian
in the files llama.cpp writes; big-endian ones are refused.

The `gguf` package's `GGUFReader` makes a NumPy view of every item of every metadata array: a
BPE vocabulary of 49,152 tokens and as many merges takes it 2.3 s, at every start of the engine
and again for its tokenizer; `struct` reads the same header in 0.08 s
(`benchmarks/serving/startup.py`). The `gguf` package still supplies the tensor types' block
sizes and the dequantisation.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # version 1 counted lengths in 32 bits
DEFAULT_ALIGNMENT = 32
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
# Tensor types whose data is a plain array; any other type is blocks of bytes, one row of
# blocks per row of the tensor (what `gguf.quants.dequantize` takes).
_PLAIN_TENSOR_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFError(ValueError):
    """Not a GGUF file, or one cut short or malformed; the message says what and where."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file. `shape` is in NumPy order (GGUF lists dimensions innermost
    first); `data` is a read-only view of the file (its `nbytes` are the tensor's bytes): typed
    for the plain types, otherwise `uint8` of shape `(*shape[:-1], bytes per row)`."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data_offset: int  # from the start of the file
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's version, metadata (in file order) and tensors."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


class _Cursor:
    """Reads the header front to back; any read past the end is a truncated file."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer, self.offset = buffer, 0

    def take(self, n: int) -> int:
        """Advance over `n` bytes; the offset where they start."""
        start, self.offset = self.offset, self.offset + n
        if self.offset > len(self.buffer):
            raise GGUFError(
                f"truncated GGUF file: the header needs byte {self.offset}, the file has "
                f"{len(self.buffer)}"
            )
        return start

    def scalar(self, fmt: str) -> Any:
        return struct.unpack_from(fmt, self.buffer, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        length = self.scalar("<Q")
        start = self.take(length)
        try:
            return self.buffer[start : start + length].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFError(f"a string at byte {start} is not UTF-8 ({exc})") from exc

    def value(self, kind: int) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            return self.array()
        if kind not in _SCALAR_FORMATS:
            raise GGUFError(f"unknown metadata value type {kind} at byte {self.offset - 4}")
        return self.scalar(_SCALAR_FORMATS[kind])

    def array(self) -> list[Any]:
        kind, count = self.scalar("<I"), self.scalar("<Q")
        if kind in _SCALAR_FORMATS:  # one read for the whole array
            fmt = _SCALAR_FORMATS[kind]
            start = self.take(count * struct.calcsize(fmt))
            return list(struct.unpack_from(f"<{count}{fmt[1]}", self.buffer, start))
        return [self.value(kind) for _ in range(count)]


def read_gguf_file(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's header and map its tensors; `GGUFError` for anything malformed,
    `FileNotFoundError` for a missing file."""
    path = Path(path)
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 4 + 4 + 8 + 8:  # magic, version, tensor count, key/value count
            raise GGUFError(f"truncated GGUF file ({size} bytes, shorter than a header)")
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with buffer:
        cursor = _Cursor(buffer)
        if buffer[:4] != GGUF_MAGIC:
            raise GGUFError(f"not a GGUF file (bad magic: starts with {buffer[:4]!r})")
        cursor.take(4)
        version = cursor.scalar("<I")
        if version & 0xFFFF == 0:
            raise GGUFError("a big-endian GGUF file; only little-endian files are read")
        if version not in SUPPORTED_VERSIONS:
            raise GGUFError(f"GGUF version {version}; versions {SUPPORTED_VERSIONS} are read")
        n_tensors, n_metadata = cursor.scalar("<Q"), cursor.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_metadata):
            key = cursor.string()
            if key in metadata:
                raise GGUFError(f"metadata key {key!r} appears twice")
            metadata[key] = cursor.value(cursor.scalar("<I"))
        records = [_tensor_record(cursor) for _ in range(n_tensors)]
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"general.alignment {alignment!r} is not a power of two")
        data_start = -(-cursor.offset // alignment) * alignment
    file_data = np.memmap(path, mode="r")
    tensors: dict[str, GGUFTensor] = {}  # by name, in file order
    for record in records:
        if record[0] in tensors:
            raise GGUFError(f"tensor {record[0]} appears twice")
        tensors[record[0]] = _tensor(file_data, record, data_start, size)
    return GGUFFile(path, version, metadata, list(tensors.values()))


def check_types(values: Mapping[str, Any], kinds: Mapping[str, str], where: str,
                error: type[ValueError] = ValueError) -> None:
    """Raise `error` naming the first key of `kinds` whose value (when present and not null) is
    not of its JSON type: "int" (not a bool), "number", "bool", "string", "object", "list of
    <type>" or "<type> or <type>". Read metadata is checked so (and so is a config.json)."""

    def fits(value: Any, kind: str) -> bool:
        if " or " in kind:
            return any(fits(value, one) for one in kind.split(" or "))
        if kind.startswith("list of "):
            return isinstance(value, list) and all(fits(v, kind[8:]) for v in value)
        if isinstance(value, bool):
            return kind == "bool"
        return isinstance(value, {"int": int, "number": (int, float), "bool": bool,
                                  "object": dict, "string": str}[kind])

    for key, kind in kinds.items():
        if values.get(key) is not None and not fits(values[key], kind):
            raise error(f"{where}: {key} must be {kind}, not {values[key]!r:.60}")


# A tensor's record in the header: name, type, shape (NumPy order), offset in the data section.
_Record = tuple[str, GGMLQuantizationType, tuple[int, ...], int]


def _tensor_record(cursor: _Cursor) -> _Record:
    """One tensor record of the header: name, type, shape (NumPy order), data offset."""
    name = cursor.string()
    dims = [cursor.scalar("<Q") for _ in range(cursor.scalar("<I"))]
    raw_type = cursor.scalar("<I")
    try:
        tensor_type = GGMLQuantizationType(raw_type)
    except ValueError as exc:
        raise GGUFError(f"tensor {name} has an unknown type {raw_type}") from exc
    return name, tensor_type, tuple(reversed(dims)), cursor.scalar("<Q")


def _tensor(file_data: np.ndarray, record: _Record, data_start: int, size: int) -> GGUFTensor:
    """The tensor's view of the file (of `size` bytes, its data section at `data_start`), once
    its bytes are known to lie inside it."""
    name, tensor_type, shape, offset = record
    offset += data_start
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    row = shape[-1] if shape else 1
    if row % block_size:
        raise GGUFError(
            f"tensor {name}: rows of {row} are not whole {tensor_type.name} blocks of {block_size}"
        )
    n_bytes = math.prod(shape) // block_size * type_size
    if offset + n_bytes > size:
        raise GGUFError(
            f"truncated GGUF file: tensor {name} needs bytes up to {offset + n_bytes}, the "
            f"file has {size}"
        )
    data = file_data[offset : offset + n_bytes]
    if tensor_type in _PLAIN_TENSOR_DTYPES:
        data = data.view(_PLAIN_TENSOR_DTYPES[tensor_type]).reshape(shape)
    else:
        data = data.reshape(*shape[:-1], row // block_size * type_size)
    return GGUFTensor(name, tensor_type, shape, offset, data)
