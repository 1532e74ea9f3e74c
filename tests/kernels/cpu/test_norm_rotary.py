"""The C RMSNorm, rotary and SiLU-and-multiply kernels against the modules they stand in for.

`minipaged.models.layers` computes each in plain PyTorch (`RMSNorm`, `RotaryEmbedding`, whose
rotary is Hugging Face's `rotate_half` form, `SiluAndMul`), and those modules are the reference
here; the CPU platform's subclasses of them call these kernels (`platforms.cpu.modules`,
tested in `tests/platforms/cpu/test_modules.py`). The rotary must equal
PyTorch's bit for bit in float32 and bfloat16 (each product and the sum rounded to the dtype, no
fused multiply-add); the norm adds its squares in another order, so it is within a few units in
the last place in float32 and within two bfloat16 steps (its normalised value and then its
product with the weight may each round the other way); the residual add before a norm
(`bind_add_rms_norm`) is PyTorch's add bit for bit; SiLU-and-multiply takes the C library's
exponential, so it is within a few units in the last place in float32 and two bfloat16 steps.
Inputs are drawn with hypothesis: row counts from 1, head dims and widths that are and are not
multiples of a vector, rows of a fused projection's output (strided), and magnitudes from tiny
to large.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from minipaged.kernels.cpu.norm_rotary import (
    NORM_PROFILER_NAME,
    bind_add_rms_norm,
    bind_gather_rows,
    bind_silu_mul,
    bind_to_float32,
    norm_rotary_available,
    rms_norm,
    rms_norm_supports,
    rotary,
    rotary_supports,
    silu_mul,
    silu_mul_supports,
)
from minipaged.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul

DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`minipaged.models.layers.RMSNorm` holding `weight`, over `x`."""
    norm = RMSNorm(weight.shape[0], eps).to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


def torch_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`minipaged.models.layers.RotaryEmbedding` turning `x [T, H, D]` by each token's row of
    `cos`, `sin` (`[T, 1, D]`): the module with those rows as its tables, at positions 0..T-1."""
    rotary = RotaryEmbedding.__new__(RotaryEmbedding)
    nn.Module.__init__(rotary)
    rotary.register_buffer("cos", cos.reshape(x.shape[0], -1))
    rotary.register_buffer("sin", sin.reshape(x.shape[0], -1))
    return rotary(torch.arange(x.shape[0]), x, x)[0]


def test_the_kernels_are_built_on_this_machine():
    assert norm_rotary_available()


@given(dtype=DTYPES, rows=st.integers(1, 9), width=st.sampled_from([1, 7, 16, 64, 576, 1000]),
       scale=st.sampled_from([1e-3, 1.0, 300.0]), eps=st.sampled_from([1e-6, 1e-5]),
       seed=st.integers(0, 2**16))
@settings(max_examples=80, deadline=None)
def test_rms_norm_equals_pytorch(dtype, rows, width, scale, eps, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, width, generator=gen) * scale).to(dtype)
    weight = (torch.randn(width, generator=gen) + 1).to(dtype)
    assert rms_norm_supports(x, weight)
    got, want = rms_norm(x, weight, eps), torch_rms_norm(x, weight, eps)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # the normalised value may round the other way, and then the product: a bfloat16
        # step is up to 2**-7 of a value (8 significant bits), so two steps are 2**-6
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=1e-6)


@given(dtype=DTYPES, tokens=st.integers(1, 6), heads=st.integers(1, 5),
       head_dim=st.sampled_from([2, 8, 64, 128]), fused=st.booleans(),
       seed=st.integers(0, 2**16))
@settings(max_examples=80, deadline=None)
def test_rotary_equals_pytorch_bit_for_bit(dtype, tokens, heads, head_dim, fused, seed):
    gen = torch.Generator().manual_seed(seed)
    if fused:  # the q columns of a fused q | k | v output: rows further apart than the heads
        x = torch.randn(tokens, 3 * heads * head_dim, generator=gen).to(dtype)
        x = x[:, : heads * head_dim].view(tokens, heads, head_dim)
    else:
        x = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=gen) * 100
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    assert rotary_supports(x, cos, sin)
    got = rotary(x, cos, sin)
    assert got.is_contiguous()
    assert torch.equal(got, torch_rotary(x, cos, sin))


def assert_close_to(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # two bfloat16 steps: each is up to 2**-7 of a value
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=1e-6)


@given(dtype=DTYPES, rows=st.integers(1, 9), width=st.sampled_from([1, 7, 16, 576, 1000]),
       scale=st.sampled_from([1e-3, 1.0, 300.0]), seed=st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_add_rms_norm_adds_as_pytorch_then_normalises(dtype, rows, width, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, width, generator=gen) * scale).to(dtype)
    residual = (torch.randn(rows, width, generator=gen) * scale).to(dtype)
    weight = (torch.randn(width, generator=gen) + 1).to(dtype)
    summed = x + residual
    out = torch.empty_like(x)
    bind_add_rms_norm(x, residual, weight, 1e-6, out)()
    assert torch.equal(x, summed)  # the add, in place, rounded as PyTorch's
    assert_close_to(out, torch_rms_norm(summed, weight, 1e-6), dtype)
    with pytest.raises(ValueError, match="out not x"):
        bind_add_rms_norm(x, residual, weight, 1e-6, x)


@given(dtype=DTYPES, rows=st.integers(1, 9), width=st.sampled_from([1, 7, 16, 100, 1536]),
       fused=st.booleans(), scale=st.sampled_from([1e-2, 1.0, 30.0]),
       seed=st.integers(0, 2**16))
@settings(max_examples=80, deadline=None)
def test_silu_mul_equals_pytorch(dtype, rows, width, fused, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    if fused:  # the two halves of a fused gate | up output: rows 2 * width apart
        both = (torch.randn(rows, 2 * width, generator=gen) * scale).to(dtype)
        gate, up = both.chunk(2, dim=1)
    else:
        gate = (torch.randn(rows, width, generator=gen) * scale).to(dtype)
        up = (torch.randn(rows, width, generator=gen) * scale).to(dtype)
    assert silu_mul_supports(gate, up)
    got = silu_mul(gate, up)
    assert got.is_contiguous() and got.dtype == dtype
    assert_close_to(got, SiluAndMul()(gate, up), dtype)
    out = torch.empty_like(got)
    bind_silu_mul(gate, up, out)()
    assert torch.equal(out, got)
    with pytest.raises(ValueError, match="apart from gate and up"):
        bind_silu_mul(gate, up, gate if not fused else both[:, :width])


@given(dtype=DTYPES, table_rows=st.integers(1, 50), width=st.sampled_from([1, 7, 64, 576]),
       data=st.data())
@settings(max_examples=40, deadline=None)
def test_gather_rows_equals_an_embedding_look_up(dtype, table_rows, width, data):
    index = data.draw(st.lists(st.integers(0, table_rows - 1), min_size=1, max_size=9))
    table = torch.randn(table_rows, width).to(dtype)
    ids = torch.tensor(index, dtype=torch.int64)
    out = torch.full((len(index), width), float("nan"), dtype=dtype)
    assert bind_gather_rows(table, ids, out)() == 0
    assert torch.equal(out, torch.nn.functional.embedding(ids, table))


@pytest.mark.parametrize("bad", [-1, 5, 2**40])
def test_gather_rows_refuses_an_index_outside_the_table_and_writes_nothing(bad):
    table, out = torch.randn(5, 8), torch.zeros(3, 8)
    assert bind_gather_rows(table, torch.tensor([0, bad, 1]), out)() != 0
    assert torch.equal(out, torch.zeros(3, 8))
    with pytest.raises(ValueError, match="out must be"):
        bind_gather_rows(table, torch.tensor([0, 1]), out)


@given(shape=st.sampled_from([(1, 1), (2, 7), (3, 1000)]), seed=st.integers(0, 2**16))
@settings(max_examples=10, deadline=None)
def test_to_float32_widens_bfloat16_exactly(shape, seed):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 1e3).bfloat16()
    x.view(-1)[0] = float("inf")
    out = torch.zeros(shape)
    assert bind_to_float32(x, out)() == 0
    assert torch.equal(out, x.float())
    with pytest.raises(ValueError, match="contiguous bfloat16"):
        bind_to_float32(x.float(), out)


def test_what_the_kernels_do_not_take_is_left_to_pytorch():
    x, weight = torch.randn(2, 8), torch.ones(8)
    assert not rms_norm_supports(x.t(), torch.ones(2))  # not contiguous
    assert not rms_norm_supports(x.half(), weight.half())  # float16
    assert not rms_norm_supports(x, weight.double())  # dtypes differ
    assert not rms_norm_supports(x, torch.ones(4))  # wrong width
    with torch.enable_grad():
        assert not rms_norm_supports(x.requires_grad_(), weight)  # gradients wanted
    q = torch.randn(2, 3, 8)
    cos = sin = torch.randn(2, 1, 8)
    assert rotary_supports(q, cos, sin)
    assert not rotary_supports(q.transpose(0, 1), cos[:1].expand(3, 1, 8), sin[:1].expand(3, 1, 8))
    assert not rotary_supports(q[..., ::2], cos[..., :4], sin[..., :4])  # heads strided
    assert not rotary_supports(q, cos.expand(2, 3, 8), sin)  # a cos per head
    assert not rotary_supports(torch.randn(2, 3, 7), torch.randn(2, 1, 7), torch.randn(2, 1, 7))
    gate = torch.randn(3, 8)
    assert silu_mul_supports(gate, torch.randn(3, 8))
    assert not silu_mul_supports(gate, torch.randn(3, 4))  # shapes differ
    assert not silu_mul_supports(gate[:, ::2], torch.randn(3, 4))  # a row strided
    assert not silu_mul_supports(gate, torch.randn(3, 16)[:, :8])  # rows apart differently
    assert not silu_mul_supports(gate.half(), gate.half())  # float16


@pytest.mark.parametrize("profiling", [False, True])
def test_profiles_under_its_own_name_only_while_a_profiler_runs(profiling):
    from torch.profiler import ProfilerActivity, profile

    x, weight = torch.randn(2, 8), torch.ones(8)
    if profiling:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            rms_norm(x, weight, 1e-6)
        assert NORM_PROFILER_NAME in {event.key for event in prof.key_averages()}
    else:
        entered = []
        real = torch.profiler.record_function
        torch.profiler.record_function = lambda name: entered.append(name) or real(name)
        try:
            rms_norm(x, weight, 1e-6)
        finally:
            torch.profiler.record_function = real
        assert entered == []
