"""`EngineConfig`: float32 by default, "auto" picks bfloat16 only where native; every field
of the wrong type is a TypeError naming it, every value out of range a ValueError naming it;
what the device decides is settled at construction by the device's platform, once."""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minipaged.engine.config import DTYPE_CHOICES, EngineConfig
from minipaged.platforms import Platform, platform_class
from minipaged.platforms.cpu import CPUPlatform, cpu_flags


def test_the_default_is_exact_float32():
    assert EngineConfig().dtype == "float32"
    assert EngineConfig().torch_dtype == torch.float32


def test_auto_is_bfloat16_exactly_where_the_device_multiplies_it_natively():
    for device in ("cpu", "meta"):
        config = EngineConfig(dtype="auto", device=device)
        native = platform_class(device).native_bfloat16()
        assert config.dtype == ("bfloat16" if native else "float32")  # settled, not "auto"
        assert config.torch_dtype == (torch.bfloat16 if native else torch.float32)
    assert platform_class("meta") is Platform and not Platform.native_bfloat16()
    native = bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
    assert CPUPlatform.native_bfloat16() == native
    assert "avx512_bf16" in cpu_flags() or not torch.cpu._is_avx512_bf16_supported()  # agrees


def test_the_platform_settles_the_config_once_at_construction():
    """Defaults, the attention backend and the device come from the device's platform; a
    settled config settles to itself, and what the device cannot run is refused at once."""
    config = EngineConfig(device="cpu")
    assert (config.dtype, config.max_num_seqs, config.max_num_batched_tokens,
            config.attention_backend) == ("float32", 64, 2048, "cpu")
    assert EngineConfig(**{f.name: getattr(config, f.name) for f in fields(config)}) == config
    assert EngineConfig(device="meta").attention_backend == "torch"
    assert EngineConfig(max_num_seqs=3, attention_backend="torch").max_num_seqs == 3  # as given
    with pytest.raises(ValueError, match="quantization 'int8' needs a platform that has it"):
        EngineConfig(device="meta", quantization="int8")
    with pytest.raises(ValueError, match="dtype float32, got 1 and bfloat16"):
        EngineConfig(device="cpu", quantization="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="tensor parallelism runs on cpu or cuda"):
        EngineConfig(device="meta", tensor_parallel_size=2)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_named_dtypes_are_taken_as_given(name):
    assert EngineConfig(dtype=name).torch_dtype == getattr(torch, name)


def test_an_unknown_dtype_is_refused_naming_the_field():
    assert "auto" in DTYPE_CHOICES
    with pytest.raises(ValueError, match=r"dtype must be None or one of .*'auto'.*got 'bf16'"):
        EngineConfig(dtype="bf16")


# -- every field's type and range -----------------------------------------------------------------

FIELDS = [f.name for f in fields(EngineConfig)]
WRONG = [
    "16", "", "auto", b"1", 1.5, -1, 0, 2**31, 2**63, 2**64, 10**400, -(10**400), True, None,
    math.inf, -math.inf, math.nan, 1e308, [], [16], {}, (1,), object(), Path("x"),
]
wrong_values = st.one_of(st.sampled_from(WRONG), st.integers(), st.floats(), st.text(max_size=4),
                         st.lists(st.integers(), max_size=2))


@settings(max_examples=400, deadline=None)
@given(name=st.sampled_from(FIELDS), value=wrong_values)
@example(name="dtype", value=None)
@example(name="max_num_seqs", value=None)
def test_every_field_is_refused_by_name_or_holds_a_value_of_its_type(name, value) -> None:
    """`LLM(block_size="16")` raised "'<' not supported between 'str' and 'int'": now every
    field of the wrong type is a TypeError, every value out of range a ValueError, each
    naming the field."""
    try:
        config = EngineConfig(**{name: value})
    except (TypeError, ValueError) as exc:
        assert name in str(exc), str(exc)
        if isinstance(exc, TypeError):
            assert str(exc).startswith(f"{name} must be "), str(exc)
        return
    held = getattr(config, name)
    platform = platform_class(config.device)
    if value is None and name in platform.defaults:
        assert held == platform.defaults[name]  # None means "the device's own value"
        return
    if value in (None, "auto") and name in ("dtype", "device", "attention_backend"):
        assert held not in (None, "auto")  # settled by the platform
        return
    assert held is value
    default = next(f.default for f in fields(EngineConfig) if f.name == name)
    if isinstance(default, bool):
        assert type(held) is bool
    elif isinstance(default, int):
        assert type(held) is int and 0 <= held < 2**64
    elif isinstance(default, float):
        assert not isinstance(held, bool) and math.isfinite(held)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"block_size": "16"}, TypeError, r"^block_size must be an int, got '16'"),
        ({"enable_prefix_caching": 1}, TypeError, r"^enable_prefix_caching must be a bool"),
        ({"swap_space": "1"}, TypeError, r"^swap_space must be a float"),
        ({"mlfq": {}}, TypeError, r"^mlfq must be an? MLFQConfig or None"),
        ({"num_gpu_blocks": 2**31}, ValueError, r"^num_gpu_blocks must be None or an integer"),
        ({"swap_space": math.nan}, ValueError, r"^swap_space must be a finite number"),
        ({"device": "gpu9"}, ValueError, r"^device must be None or a torch device"),
        ({"preemption_mode": "drop"}, ValueError, r"^preemption_mode must be None or one of"),
        (
            {"scheduler": "mlfq-recompute", "preemption_mode": "swap"},
            ValueError,
            r"^preemption_mode must be None or 'recompute' for scheduler 'mlfq-recompute'",
        ),
        ({"attention_backend": "flash"}, ValueError, r"^attention_backend must be None"),
        ({"seed": 2**64}, ValueError, r"^seed must be an integer in \[0, 2\*\*64\)"),
    ],
)
def test_a_wrong_setting_names_the_field(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        EngineConfig(**kwargs)


def test_llm_refuses_a_wrong_setting_before_loading_anything(monkeypatch) -> None:
    from minipaged.engine import engine as engine_module
    from minipaged.engine.llm import LLM

    def no_load(*args, **kwargs):
        raise AssertionError("nothing may load for a bad setting")

    monkeypatch.setattr(engine_module.LLMEngine, "__init__", no_load)
    with pytest.raises(TypeError, match=r"^block_size must be an int, got '16'"):
        LLM(block_size="16")
    with pytest.raises(TypeError, match=r"^model must be a str, a Path or None"):
        LLM(model=5)
