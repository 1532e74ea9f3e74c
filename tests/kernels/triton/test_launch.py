"""`minipaged.kernels.triton.launch`: launches as data and the tile-size rules every launcher
uses, and the prefill kernel's tile table."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minipaged.kernels.triton import launch
from minipaged.kernels.triton.launch import (
    FP32_KV_TILE_ELEMENTS,
    MIN_DOT_SIZE,
    KernelLaunch,
    check_power_of_two,
    default_key_tile,
    pow2_at_least,
)
from minipaged.kernels.triton.prefill import INTERPRETER_TILES, prefill_tiles


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@given(n=st.integers(-4, 5000), minimum=st.sampled_from([1, 2, 16, 64]))
def test_pow2_at_least_is_the_smallest_power_of_two_not_below_n_and_minimum(n, minimum):
    got = pow2_at_least(n, minimum)
    assert is_power_of_two(got) and got >= max(n, minimum)
    assert got == minimum or got // 2 < max(n, 1)  # no smaller power of two would do


@given(value=st.integers(-8, 1100), minimum=st.sampled_from([1, 16]))
def test_check_power_of_two_rejects_exactly_the_others(value, minimum):
    if is_power_of_two(value) and value >= minimum:
        check_power_of_two("tile", value, minimum)
    else:
        with pytest.raises(ValueError, match=f"tile must be a power of two >= {minimum}"):
            check_power_of_two("tile", value, minimum)


@pytest.mark.parametrize("interpret", ["1", "0"])
@given(head_dim_pad=st.sampled_from([16, 32, 64, 128, 256, 512]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_a_key_tile_is_sized_by_its_registers_and_big_enough_for_a_dot(
    interpret, head_dim_pad, dtype
):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", interpret)
        assert launch.interpreting() == (interpret == "1")
        tile = default_key_tile(dtype, head_dim_pad)
    assert tile >= MIN_DOT_SIZE and is_power_of_two(tile)
    if interpret == "1":
        assert tile == 128  # the interpreter: one size, large
    elif dtype != torch.float32:
        assert tile == 64
    else:  # float32 tiles are shorter: twice the bytes, and three TF32 products
        assert tile * head_dim_pad <= FP32_KV_TILE_ELEMENTS or tile == MIN_DOT_SIZE
        assert tile == (32 if head_dim_pad <= 128 else 16)


def test_a_launch_runs_its_kernel_on_its_grid_with_its_arguments():
    calls = []

    class FakeKernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs)) or "compiled"

    plan = KernelLaunch("k", FakeKernel(), (3, 2), (1, 2.0), {"BLOCK": 16}, num_warps=8)
    assert plan() == "compiled"
    assert calls == [((3, 2), (1, 2.0), {"BLOCK": 16, "num_warps": 8})]
    # Pipeline stages are passed only when the plan sets them (else Triton's default).
    KernelLaunch("k", FakeKernel(), (1,), (), {}, num_warps=4, num_stages=3)()
    assert calls[-1] == ((1,), (), {"num_warps": 4, "num_stages": 3})


@pytest.mark.parametrize("interpret", ["1", "0"])
@given(head_dim_pad=st.sampled_from([16, 32, 64, 128, 256, 512]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_prefill_tiles_fit_a_dot_and_shrink_for_float32_and_wide_heads(
    interpret, head_dim_pad, dtype
):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", interpret)
        tiles = prefill_tiles(dtype, head_dim_pad)
    for size in (tiles.rows, tiles.keys, tiles.num_warps):
        assert is_power_of_two(size)
    assert tiles.rows >= MIN_DOT_SIZE and tiles.keys >= MIN_DOT_SIZE and tiles.num_stages >= 1
    if interpret == "1":
        assert tiles == INTERPRETER_TILES
    elif dtype == torch.float32:  # "tf32x3" keeps two parts of every operand: smaller tiles
        assert tiles.rows * tiles.keys <= prefill_tiles(torch.float16, head_dim_pad).rows * \
            prefill_tiles(torch.float16, head_dim_pad).keys
    else:  # FlashAttention-2's tiles up to head dim 128, smaller beyond
        assert (tiles.rows, tiles.keys) == ((128, 64) if head_dim_pad <= 128 else
                                            (64 * 256 // head_dim_pad, 32))
