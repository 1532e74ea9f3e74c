"""minipaged.tokenizer.gguf_file: GGUF headers read the way the `gguf` package reads them.

* Files written by `gguf.GGUFWriter` with arbitrary metadata (every value type, arrays, nested
  arrays, any alignment) and tensors (plain and block-quantised types): the values and arrays
  written come back, and equal `gguf.GGUFReader`'s (the oracle) key for key and tensor for tensor.
* The bundled SmolLM2 file against `GGUFReader`, in full.
* A file cut short anywhere is a "truncated" `GGUFError`; a header with bytes overwritten at
  random parses or is a `GGUFError`; malformed headers, built byte by byte, are refused with an
  error naming what is wrong.
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.tokenizer.gguf_file import GGUFError, read_gguf_file

V = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType

# value type -> values of it that survive the round trip exactly
_INTS = {
    V.UINT8: (0, 2**8 - 1), V.INT8: (-(2**7), 2**7 - 1), V.UINT16: (0, 2**16 - 1),
    V.INT16: (-(2**15), 2**15 - 1), V.UINT32: (0, 2**32 - 1), V.INT32: (-(2**31), 2**31 - 1),
    V.UINT64: (0, 2**64 - 1), V.INT64: (-(2**63), 2**63 - 1),
}
_SCALARS = {
    **{kind: st.integers(lo, hi) for kind, (lo, hi) in _INTS.items()},
    V.FLOAT32: st.floats(width=32, allow_nan=False),
    V.FLOAT64: st.floats(allow_nan=False),
    V.BOOL: st.booleans(),
    V.STRING: st.text(max_size=12),
}


@st.composite
def metadata_entries(draw) -> tuple:
    """(value type, array item type or None, value) of one metadata entry."""
    kind = draw(st.sampled_from([*_SCALARS, V.ARRAY, V.ARRAY]))
    if kind != V.ARRAY:
        return kind, None, draw(_SCALARS[kind])
    item = draw(st.sampled_from([*_SCALARS, V.ARRAY]))
    if item == V.ARRAY:  # arrays of int32 arrays (the writer infers the inner type)
        inner = st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=4)
        return kind, item, draw(st.lists(inner, min_size=1, max_size=4))
    return kind, item, draw(st.lists(_SCALARS[item], min_size=1, max_size=20))


_TENSOR_TYPES = {Q.F32: np.float32, Q.F16: np.float16, Q.I8: np.int8, Q.I32: np.int32}


@st.composite
def tensors(draw) -> dict[str, tuple[np.ndarray, Q]]:
    """Arrays by name, each with the type it is stored in: plain types of any shape, and Q8_0
    (rows of whole 32-element blocks)."""
    out = {}
    for i in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from([*_TENSOR_TYPES, Q.Q8_0]))
        if kind == Q.Q8_0:
            shape = (draw(st.integers(1, 3)), 32 * draw(st.integers(1, 2)))
            rows = np.random.default_rng(i).standard_normal(shape, dtype=np.float32)
            out[f"t{i}"] = (gguf.quants.quantize(rows, kind), kind)
        else:
            shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
            values = np.arange(np.prod(shape)).reshape(shape) % 100 - 50
            out[f"t{i}"] = (values.astype(_TENSOR_TYPES[kind]), kind)
    return out


def write(path: Path, metadata: dict[str, tuple], arrays: dict, alignment: int | None) -> Path:
    writer = gguf.GGUFWriter(path, arch="llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (kind, item, value) in metadata.items():
        writer.add_key_value(key, value, kind, sub_type=item)
    for name, (array, kind) in arrays.items():
        writer.add_tensor(name, array, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def as_written(kind: V, item: V | None, value):
    """The value a reader gives back: floats rounded to float32 where stored so."""
    if kind == V.FLOAT32:
        return float(np.float32(value))
    if kind == V.ARRAY and item == V.FLOAT32:
        return [float(np.float32(v)) for v in value]
    return value


def oracle_value(field):
    value = field.contents()
    return value.item() if isinstance(value, np.generic) else value


def assert_same_as_gguf_reader(path: Path) -> None:
    ours, theirs = read_gguf_file(path), gguf.GGUFReader(path)
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    for key, field in fields.items():
        mine = ours.metadata[key]
        if field.types[:2] == [V.ARRAY, V.ARRAY]:  # GGUFReader flattens arrays of arrays
            mine = [item for inner in mine for item in inner]
        assert mine == oracle_value(field) and type(mine) is type(oracle_value(field)), key
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, oracle in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type) == (oracle.name, oracle.tensor_type)
        assert mine.shape == tuple(reversed(oracle.shape.tolist()))
        assert (mine.data_offset, mine.data.nbytes) == (oracle.data_offset, oracle.n_bytes)
        assert mine.data.dtype == oracle.data.dtype and mine.data.shape == oracle.data.shape
        assert np.array_equal(mine.data, oracle.data) and not mine.data.flags.writeable


@settings(max_examples=40)
@given(
    metadata=st.dictionaries(st.text(min_size=1, max_size=8), metadata_entries(), max_size=8),
    arrays=tensors(),
    alignment=st.sampled_from([None, 1, 8, 64, 256]),
)
def test_what_was_written_comes_back_as_gguf_reader_reads_it(
    tmp_path_factory, metadata, arrays, alignment
) -> None:
    metadata.pop("general.architecture", None)  # the writer adds its own
    metadata.pop("general.alignment", None)
    path = write(tmp_path_factory.mktemp("gguf") / "f.gguf", metadata, arrays, alignment)
    got = read_gguf_file(path)
    expected = {k: as_written(*entry) for k, entry in metadata.items()}
    assert {k: v for k, v in got.metadata.items() if not k.startswith("general.")} == expected
    assert got.metadata["general.architecture"] == "llama" and got.version == 3
    for tensor, (name, (array, kind)) in zip(got.tensors, arrays.items(), strict=True):
        assert (tensor.name, tensor.tensor_type) == (name, kind)
        assert np.array_equal(tensor.data, array) and tensor.data.dtype == array.dtype
        assert tensor.data_offset % (alignment or 32) == 0
    assert_same_as_gguf_reader(path)


def test_the_bundled_file_reads_as_gguf_reader_reads_it(bundled_path) -> None:
    assert_same_as_gguf_reader(bundled_path)


@pytest.fixture(scope="module")
def small_file(tmp_path_factory) -> Path:
    metadata = {"tokens": (V.ARRAY, V.STRING, ["a", "bc", "déf"]), "n": (V.UINT32, None, 7)}
    arrays = {"w": (np.ones((3, 4), np.float32), Q.F32)}
    return write(tmp_path_factory.mktemp("gguf") / "small.gguf", metadata, arrays, None)


@settings(max_examples=60)
@given(fraction=st.floats(0, 1, exclude_max=True))
def test_a_file_cut_short_anywhere_is_truncated(small_file, fraction) -> None:
    whole = read_gguf_file(small_file)
    end = max(t.data_offset + t.data.nbytes for t in whole.tensors)
    path = small_file.parent / "cut.gguf"  # one file, rewritten by every example
    path.write_bytes(small_file.read_bytes()[: int(fraction * end)])
    with pytest.raises(GGUFError, match="truncated"):
        read_gguf_file(path)


@settings(max_examples=300)
@given(data=st.data())
def test_a_header_with_any_bytes_changed_parses_or_is_a_gguf_error(small_file, data) -> None:
    """Bytes of the header overwritten at random (counts, lengths, types, text): the reader
    either parses the result or raises `GGUFError`, never another exception."""
    raw = bytearray(small_file.read_bytes())
    header_end = read_gguf_file(small_file).tensors[0].data_offset
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, header_end - 1))] = data.draw(st.integers(0, 255))
    path = small_file.parent / "flipped.gguf"
    path.write_bytes(bytes(raw))
    try:
        read_gguf_file(path)
    except GGUFError:
        pass


def _string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _header(*entries: bytes, version: int = 3, n_tensors: int = 0, magic=b"GGUF") -> bytes:
    return magic + struct.pack("<IQQ", version, n_tensors, len(entries)) + b"".join(entries)


def _u32_entry(key: str, value: int, kind: int = V.UINT32) -> bytes:
    return _string(key) + struct.pack("<II", kind, value)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_header(magic=b"PK\x03\x04"), "bad magic"),
        (_header(version=3 << 24), "big-endian"),
        (_header(version=1), "version 1"),
        (_header(_u32_entry("k", 1), _u32_entry("k", 2)), "'k' appears twice"),
        (_header(_u32_entry("k", 1, kind=13)), "unknown metadata value type 13"),
        (_header(_string("k") + struct.pack("<I", V.STRING) + _string(b"\xff")), "not UTF-8"),
        (_header(_u32_entry("general.alignment", 24)), "alignment 24 is not a power of two"),
        (
            _header(n_tensors=1) + _string("w") + struct.pack("<IQIQ", 1, 4, 99, 0),
            "tensor w has an unknown type 99",
        ),
        (
            _header(n_tensors=1) + _string("w") + struct.pack("<IQIQ", 1, 33, Q.Q8_0, 0),
            "rows of 33 are not whole Q8_0 blocks of 32",
        ),
        (
            _header(n_tensors=2) + (_string("w") + struct.pack("<IQIQ", 1, 1, Q.F32, 0)) * 2
            + bytes(64),
            "tensor w appears twice",
        ),
    ],
)
def test_malformed_headers_are_refused_naming_the_problem(tmp_path, data, message) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFError, match=message):
        read_gguf_file(path)


def test_a_missing_file_is_file_not_found(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        read_gguf_file(tmp_path / "missing.gguf")
