"""The fused Triton operators equal their PyTorch definitions: RMSNorm with and without the
residual add (Hugging Face's LlamaRMSNorm), SwiGLU's SiLU-and-multiply, and the rotary embedding
fused with the K/V cache write (`x * cos + rotate_half(x) * sin`, then `reshape_and_cache`).

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

import minipaged.attention.reference as reference
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


# --- rotary embedding and cache write --------------------------------------------------------


def rope_tables(max_positions: int, head_dim: int, theta: float = 10000.0):
    """cos, sin [P, D] in float32 with each pair's angle twice (the model's layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(DEVICE), angles.sin().to(DEVICE)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def reference_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotary: `x * cos + rotate_half(x) * sin`, cos/sin in x's dtype."""
    c = cos[positions][:, None, :].to(x.dtype)
    s = sin[positions][:, None, :].to(x.dtype)
    return x * c + rotate_half(x) * s


@settings(max_examples=25)
@given(
    heads=st.sampled_from([(1, 1), (4, 2), (9, 3), (8, 8)]),
    head_dim=st.sampled_from([8, 32, 64, 80, 128]),
    block_size=st.sampled_from([4, 16]),
    dtype=st.sampled_from(DTYPES),
    half_tables=st.booleans(),
    q_in_place=st.booleans(),
    k_out=st.sampled_from(["none", "in place", "new"]),
    data=st.data(),
)
def test_rotary_and_cache_equals_rotary_then_reshape_and_cache(
    heads, head_dim, block_size, dtype, half_tables, q_in_place, k_out, data
) -> None:
    num_heads, num_kv_heads = heads
    num_blocks, max_positions = 4, 4096
    num_slots = num_blocks * block_size
    num_tokens = data.draw(st.integers(0, min(num_slots, 20)))
    slots = data.draw(st.permutations(range(num_slots)))[:num_tokens]
    skip = data.draw(st.lists(st.booleans(), min_size=num_tokens, max_size=num_tokens))
    slot_mapping = torch.tensor([-1 if s else slot for slot, s in zip(slots, skip, strict=True)],
                                dtype=torch.int64, device=DEVICE)
    positions = torch.tensor(data.draw(st.lists(st.integers(0, max_positions - 1),
                                                min_size=num_tokens, max_size=num_tokens)),
                             dtype=data.draw(st.sampled_from([torch.int32, torch.int64])),
                             device=DEVICE)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    # q, k, v as views of one fused projection [T, (H + 2 H_kv) * D], as a model slices them.
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = randn((num_tokens, width), dtype, gen)
    q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = randn(cache_shape, dtype, gen)
    k_cache[0, 0] = float("nan")  # garbage where nothing is written must stay, bit for bit
    v_cache = randn(cache_shape, dtype, gen)
    cos, sin = rope_tables(max_positions, head_dim)
    if half_tables:
        cos, sin = cos[:, :head_dim // 2], sin[:, :head_dim // 2]

    want_q = reference_rotary(q, *rope_tables(max_positions, head_dim), positions.long())
    want_k = reference_rotary(k, *rope_tables(max_positions, head_dim), positions.long())
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    reference.reshape_and_cache(want_k, v, want_k_cache, want_v_cache, slot_mapping)
    k_before, v_before = k.clone(), v.clone()

    q_out = None if q_in_place else torch.empty_like(q)
    k_target = {"none": None, "in place": k, "new": torch.empty_like(k)}[k_out]
    got_q = kernels.rotary_and_cache(q, k, v, cos, sin, positions, k_cache, v_cache,
                                     slot_mapping, q_out=q_out, k_out=k_target)
    assert got_q is (q if q_in_place else q_out)
    tol = tolerance(dtype)
    torch.testing.assert_close(got_q, want_q, **tol)
    if k_target is not None:
        torch.testing.assert_close(k_target, want_k, **tol)
    if k_out != "in place":
        assert torch.equal(bits(k), bits(k_before))
    assert torch.equal(bits(v), bits(v_before))
    # Written slots hold the rotated keys and the values; every other slot is untouched.
    written = torch.zeros(num_slots, dtype=torch.bool, device=DEVICE)
    written[slot_mapping[slot_mapping >= 0]] = True
    for got, want in ((k_cache, want_k_cache), (v_cache, want_v_cache)):
        flat_got, flat_want = got.view(num_slots, -1), want.view(num_slots, -1)
        torch.testing.assert_close(flat_got[written], flat_want[written], **tol)
        assert torch.equal(bits(flat_got[~written]), bits(flat_want[~written]))
    assert torch.equal(bits(v_cache.view(num_slots, -1)[written]),
                       bits(want_v_cache.view(num_slots, -1)[written]))  # values are copied


def test_rotary_and_cache_rejects_bad_arguments() -> None:
    q = torch.zeros(2, 4, 8, device=DEVICE)
    k = v = torch.zeros(2, 2, 8, device=DEVICE)
    cos, sin = rope_tables(16, 8)
    positions = torch.tensor([0, 3], device=DEVICE)
    k_cache = v_cache = torch.zeros(2, 4, 2, 8, device=DEVICE)
    slots = torch.tensor([0, 5], device=DEVICE)
    args = [q, k, v, cos, sin, positions, k_cache, v_cache, slots]

    def call(index: int, value) -> None:
        bad = list(args)
        bad[index] = value
        kernels.rotary_and_cache(*bad)

    with pytest.raises(ValueError, match="head dim must be even"):
        kernels.rotary_and_cache(q[..., :7], k[..., :7], v[..., :7], cos[:, :7], sin[:, :7],
                                 positions, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="cos and sin"):
        call(3, cos[:, :5])
    with pytest.raises(ValueError, match="positions must lie"):
        call(5, torch.tensor([0, 16], device=DEVICE))
    with pytest.raises(ValueError, match="slot_mapping has slots outside"):
        call(8, torch.tensor([0, 8], device=DEVICE))
    with pytest.raises(ValueError, match="v must be shaped like k"):
        call(2, q)
