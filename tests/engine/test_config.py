"""`EngineConfig`'s dtype setting: float32 by default, "auto" picks bfloat16 only where native."""

from __future__ import annotations

import pytest
import torch

from minipaged.engine.config import DTYPE_CHOICES, EngineConfig, cpu_flags, native_bfloat16


def test_the_default_is_exact_float32():
    assert EngineConfig().dtype == "float32"
    assert EngineConfig().torch_dtype == torch.float32


def test_auto_is_bfloat16_exactly_where_the_device_multiplies_it_natively():
    for device in ("cpu", "meta"):
        config = EngineConfig(dtype="auto", device=device)
        expected = torch.bfloat16 if native_bfloat16(torch.device(device)) else torch.float32
        assert config.torch_dtype == expected
    assert not native_bfloat16(torch.device("meta"))
    native = bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
    assert native_bfloat16(torch.device("cpu")) == native
    assert "avx512_bf16" in cpu_flags() or not torch.cpu._is_avx512_bf16_supported()  # agrees


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_named_dtypes_are_taken_as_given(name):
    assert EngineConfig(dtype=name).torch_dtype == getattr(torch, name)


def test_an_unknown_dtype_is_refused_naming_the_field():
    assert "auto" in DTYPE_CHOICES
    with pytest.raises(ValueError, match=r"dtype must be one of .*'auto'.*got 'bf16'"):
        EngineConfig(dtype="bf16")
