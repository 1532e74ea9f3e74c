"""The fused Triton operators equal their PyTorch definitions: RMSNorm with and without the
residual add (Hugging Face's LlamaRMSNorm) and SwiGLU's SiLU-and-multiply.

Run on CPU through Triton's interpreter (conftest.py) and on CUDA by the GPU check. Tolerances
per dtype are `paged_examples.TOLERANCES`, about one unit in the last place: the kernels compute
in float32 and round where PyTorch rounds, but the interpreter stores bfloat16 by truncation and
a float32 sum may be added in another order. Values PyTorch rounds only once (the residual sum
in float32 and float16) must be equal.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged import kernels
from minipaged.testing.paged_examples import tolerance

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" \
    else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def randn(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator,
          scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bit patterns, so that NaN compares equal to itself."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


# --- RMSNorm ---------------------------------------------------------------------------------


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None):
    """Hugging Face's LlamaRMSNorm, with the pre-norm residual add before it."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed, residual


@st.composite
def norm_cases(draw: st.DrawFn) -> dict:
    dtype = draw(st.sampled_from(DTYPES))
    return {
        "lead": draw(st.sampled_from([(0,), (1,), (5,), (17,), (2, 3)])),
        "hidden": draw(st.sampled_from([1, 7, 64, 80, 576, 1000])),
        "dtype": dtype,
        "weight_dtype": draw(st.sampled_from([dtype, torch.float32])),
        "eps": draw(st.sampled_from([1e-6, 1e-5, 0.1])),
        "scale": draw(st.sampled_from([1e-3, 1.0, 30.0])),  # 30^2 * 1000 overflows float16
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=25)
@given(case=norm_cases(), in_place=st.booleans())
def test_rms_norm_equals_hugging_face(case: dict, in_place: bool) -> None:
    gen = torch.Generator().manual_seed(case["seed"])
    x = randn((*case["lead"], case["hidden"]), case["dtype"], gen, case["scale"])
    weight = randn((case["hidden"],), case["weight_dtype"], gen)
    want, _ = reference_rms_norm(x, weight, case["eps"])
    out = None
    if in_place and want.dtype == x.dtype:
        out = x.clone()  # the output over its own input
        got = kernels.rms_norm(out, weight, case["eps"], out=out)
        assert got is out
    else:
        got = kernels.rms_norm(x, weight, case["eps"])
    assert got.shape == x.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, **tolerance(x.dtype))


@settings(max_examples=25)
@given(case=norm_cases(), in_place=st.booleans())
def test_fused_add_rms_norm_equals_add_then_norm(case: dict, in_place: bool) -> None:
    gen = torch.Generator().manual_seed(case["seed"])
    shape = (*case["lead"], case["hidden"])
    x = randn(shape, case["dtype"], gen, case["scale"])
    residual = randn(shape, case["dtype"], gen, case["scale"])
    weight = randn((case["hidden"],), case["weight_dtype"], gen)
    want, want_residual = reference_rms_norm(x, weight, case["eps"], residual)
    if in_place and want.dtype == x.dtype:  # vLLM's convention: x <- normed, residual <- sum
        x_in, residual_in = x.clone(), residual.clone()
        got, got_residual = kernels.fused_add_rms_norm(
            x_in, residual_in, weight, case["eps"], out=x_in, residual_out=residual_in)
        assert got is x_in and got_residual is residual_in
    else:
        x_before, residual_before = x.clone(), residual.clone()
        got, got_residual = kernels.fused_add_rms_norm(x, residual, weight, case["eps"])
        assert torch.equal(bits(x), bits(x_before))  # inputs untouched
        assert torch.equal(bits(residual), bits(residual_before))
    assert got.dtype == want.dtype and got_residual.dtype == x.dtype
    if x.dtype == torch.bfloat16:  # the interpreter truncates where PyTorch rounds
        torch.testing.assert_close(got_residual, want_residual, **tolerance(x.dtype))
    else:
        assert torch.equal(got_residual, want_residual)
    torch.testing.assert_close(got, want, **tolerance(x.dtype))


def test_norm_rejects_inconsistent_arguments() -> None:
    x = torch.zeros(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight must be"):
        kernels.rms_norm(x, torch.ones(7, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual must match"):
        kernels.fused_add_rms_norm(x, x.half(), torch.ones(8, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="out must be"):
        kernels.rms_norm(x, torch.ones(8, device=DEVICE), 1e-6, out=x.half())
    with pytest.raises(ValueError, match="contiguous last dimension"):
        kernels.rms_norm(x.t(), torch.ones(3, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        kernels.rms_norm(x.double(), torch.ones(8, device=DEVICE), 1e-6)


# --- SiLU and multiply -----------------------------------------------------------------------


@settings(max_examples=25)
@given(lead=st.sampled_from([(0,), (1,), (6,), (33,), (2, 5)]),
       inter=st.sampled_from([1, 16, 96, 1536, 1100]),
       dtype=st.sampled_from(DTYPES), scale=st.sampled_from([1.0, 20.0]),
       seed=st.integers(0, 2**16))
def test_silu_and_mul_equals_pytorch(lead, inter, dtype, scale, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    gate_up = randn((*lead, 2 * inter), dtype, gen, scale)
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    want = F.silu(gate) * up
    got = kernels.silu_and_mul(gate_up)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, want, **tolerance(dtype))
    # The two-input form, on the strided halves, into a given output.
    out = torch.full_like(want, float("nan"))
    assert kernels.silu_mul(gate, up, out=out) is out
    torch.testing.assert_close(out, want, **tolerance(dtype))


def test_silu_and_mul_rejects_odd_widths_and_mismatched_halves() -> None:
    with pytest.raises(ValueError, match="even"):
        kernels.silu_and_mul(torch.zeros(2, 5, device=DEVICE))
    with pytest.raises(ValueError, match="must match"):
        kernels.silu_mul(torch.zeros(2, 4, device=DEVICE), torch.zeros(2, 3, device=DEVICE))
