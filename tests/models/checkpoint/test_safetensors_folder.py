"""`minipaged.models.checkpoint.safetensors_folder` on its own: finding the files and reading their
headers.

Random tensors of every dtype safetensors stores are written with the `safetensors` library and
read back through `safetensors_tensors`: names, shapes, bits and slices must all come back as
written, with buffers and a tied head's copy skipped. Headers cut short, announcing more than
the file holds, not JSON, or not an object raise `CheckpointError` naming the file; the folder
rules (config.json, the index, one file or an index) raise it naming what is missing.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from minipaged.models.checkpoint.model_config import ModelConfig
from minipaged.models.checkpoint.safetensors_folder import safetensors_folder, safetensors_tensors
from minipaged.models.checkpoint.weight_names import CheckpointError
from minipaged.models.registry import FAMILIES

CONFIG = ModelConfig(
    family=FAMILIES["llama"], vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=256,
    norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=True,
    qkv_bias=False, o_bias=False, qk_norm=False, sliding_window=None, bos_token_id=1,
    eos_token_ids=(2,), pad_token_id=None,
)
DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
]
IGNORED = ["model.layers.0.self_attn.rotary_emb.inv_freq", "lm_head.weight"]  # head is tied
fresh_dir = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


def random_tensor(draw, dtype: torch.dtype) -> torch.Tensor:
    shape = tuple(draw(st.lists(st.integers(1, 4), max_size=3)))
    seed = draw(st.integers(0, 2**16))
    bits = torch.randint(0, 256, (*shape, dtype.itemsize), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))
    tensor = bits.view(dtype).reshape(shape)  # every bit pattern, NaNs and infinities included
    return tensor != 0 if dtype == torch.bool else tensor


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (NaN payloads compare too), with its shape in front."""
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    return torch.cat([torch.tensor(tensor.shape, dtype=torch.int64).view(torch.uint8), flat])


@st.composite
def tensors(draw) -> dict[str, torch.Tensor]:
    dtypes = draw(st.lists(st.sampled_from(DTYPES), min_size=1, max_size=6))
    names = draw(st.lists(st.from_regex(r"[a-z]{1,6}(\.[a-z0-9]{1,4}){0,3}", fullmatch=True),
                          min_size=len(dtypes), max_size=len(dtypes), unique=True))
    return {n: random_tensor(draw, d) for n, d in zip(names, dtypes, strict=True)}


@fresh_dir
@given(state=tensors(), with_ignored=st.booleans(), data=st.data())
def test_random_tensors_of_every_dtype_come_back_bit_for_bit(
    tmp_path, state, with_ignored, data
) -> None:
    file = tmp_path / "model.safetensors"
    stored = dict(state)
    if with_ignored:
        stored |= {name: torch.zeros(2) for name in IGNORED if name not in state}
    save_file(stored, file, metadata={"format": "pt"})
    pending = safetensors_tensors(file, CONFIG)
    assert set(pending) == set(state) - set(IGNORED)
    for name, tensor in state.items():
        if name in IGNORED:
            continue
        got = pending[name]
        assert got.shape == tuple(tensor.shape) and got.origin == name
        read = got.read()
        assert read.dtype == tensor.dtype
        assert torch.equal(bits(read), bits(tensor))
        index = tuple(
            slice(data.draw(st.integers(0, n - 1)), data.draw(st.integers(1, n)))
            for n in tensor.shape
        )
        assert torch.equal(bits(got.part(index)), bits(tensor[index]))


def write_raw(path: Path, header: bytes, announced: int | None = None, data: bytes = b"") -> Path:
    size = len(header) if announced is None else announced
    path.write_bytes(struct.pack("<Q", size) + header + data)
    return path


def error_of(file: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        safetensors_tensors(file, CONFIG)
    assert str(file) in str(info.value)
    return str(info.value)


@fresh_dir
@given(state=tensors(), fraction=st.floats(0, 1, exclude_max=True))
def test_a_file_cut_anywhere_is_a_checkpoint_error_naming_it(tmp_path, state, fraction) -> None:
    whole = tmp_path / "whole.safetensors"
    save_file(state, whole)
    data = whole.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: int(fraction * len(data))])
    assert "truncated" in error_of(cut)


@pytest.mark.parametrize(
    "header, announced, message",
    [
        (b'{"a": 1', None, "bad header"),
        (b"\xff\xfe{}", None, "bad header"),
        (b"[1, 2]", None, "not a JSON object"),
        (b"{}", 10**6, "header of 1000000 bytes announced"),
        (b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}', None,
         "tensor data needs 16 bytes"),
    ],
)
def test_a_foreign_or_lying_header_is_a_checkpoint_error_naming_the_file(
    tmp_path, header, announced, message
) -> None:
    assert message in error_of(write_raw(tmp_path / "bad.safetensors", header, announced))


def test_a_header_of_under_eight_bytes_is_truncated(tmp_path) -> None:
    file = tmp_path / "short.safetensors"
    file.write_bytes(b"\x02\x00\x00")
    assert "truncated safetensors file (3 bytes)" in error_of(file)


# -- safetensors_folder --------------------------------------------------------------------------


def folder_with(tmp_path: Path, files: list[str], index: object = None) -> Path:
    (tmp_path / "config.json").write_text("{}")
    for name in files:
        save_file({"x": torch.zeros(1)}, tmp_path / name)
    if index is not None:
        text = index if isinstance(index, str) else json.dumps(index)
        (tmp_path / "model.safetensors.index.json").write_text(text)
    return tmp_path


@given(shards=st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=6))
@fresh_dir
def test_an_index_gives_its_shards_once_each_in_order(tmp_path_factory, shards) -> None:
    folder = tmp_path_factory.mktemp("sharded")
    names = [f"model-{s}.safetensors" for s in shards]
    weight_map = {f"t{i}": name for i, name in enumerate(names)}
    folder_with(folder, sorted(set(names)) + ["stray.safetensors"], {"weight_map": weight_map})
    config, files = safetensors_folder(folder)
    assert config == folder / "config.json"
    assert files == [folder / n for n in sorted(set(names))]  # the stray file is not a shard


@pytest.mark.parametrize(
    "files, index, message",
    [
        (["model.safetensors"], "not json", "not a valid safetensors index"),
        (["model.safetensors"], {"weights": {}}, "not a valid safetensors index"),
        (["model.safetensors"], {"weight_map": ["x"]}, "not a valid safetensors index"),
        (["a.safetensors"], {"weight_map": {"x": "b.safetensors"}}, "b.safetensors missing"),
        ([], None, "no *.safetensors file next to config.json"),
        (["a.safetensors", "b.safetensors"], None, "2 safetensors files but no"),
    ],
)
def test_a_folder_that_breaks_the_rules_is_a_checkpoint_error(
    tmp_path, files, index, message
) -> None:
    folder = folder_with(tmp_path, files, index)
    with pytest.raises(CheckpointError, match=message.replace("*", r"\*")) as info:
        safetensors_folder(folder)
    assert str(folder) in str(info.value)


def test_a_folder_without_config_json_is_not_a_model_folder(tmp_path) -> None:
    save_file({"x": torch.zeros(1)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="config.json missing"):
        safetensors_folder(tmp_path)
