"""Fused small operators of a decoder layer: RMSNorm (with the residual add before it) and
SwiGLU's SiLU-and-multiply, one launch each.

In PyTorch an RMSNorm is eight operators (a cast, a square, a mean, an add, a reciprocal square
root, two products, a cast back) and the residual add a ninth; SwiGLU's activation is two. Each
operator is a launch and a round trip of its tensor through memory; here each is one pass. They
round as PyTorch rounds (`minipaged.models.layers.RMSNorm`, Hugging Face's `LlamaRMSNorm`):

* the residual add is computed in float32 and rounded once to the dtype, as PyTorch's add does;
* the norm is computed in float32 on that rounded sum, rounded to the input dtype, then
  multiplied by the weight: `weight * (xf * rsqrt(mean(xf^2) + eps)).to(dtype)`;
* SiLU is computed in float32 and rounded to the dtype before the product, as `F.silu(gate) *
  up` rounds.

Every launch takes its grid from tensor shapes only and reads nothing back on the host, so it
can be captured in a CUDA graph. Outputs may be given: `fused_add_rms_norm(x, residual, ...,
out=x, residual_out=residual)` writes both results in place (vLLM's and nano-vllm's
convention), which saves two allocations and lets a captured step reuse its buffers. Each
program reads its rows completely before writing them, so an output may alias its input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .launch import KernelLaunch, check_output, pow2_at_least, run_launches, tile_elements

# The widest row one RMSNorm program holds (a row is normalised in registers, in one piece).
MAX_NORM_WIDTH = 1 << 16
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# One program for every row count and width of a padded size (Triton would specialise 1 and
# multiples of 16).
@triton.jit(do_not_specialize=["num_rows", "n_cols"])
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    num_rows, n_cols, eps,
    stride_x, stride_r, stride_o, stride_ro,
    N_PAD: tl.constexpr, ROW_TILE: tl.constexpr, ADD: tl.constexpr,
):
    """ROW_TILE rows of `weight * norm(x [+ residual])`; with ADD, also the sum itself."""
    rows = tl.program_id(0) * ROW_TILE + tl.arange(0, ROW_TILE)
    cols = tl.arange(0, N_PAD)
    col_ok = cols < n_cols
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    rows = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ADD:
        residual = tl.load(residual_ptr + rows * stride_r + cols[None, :], mask=mask, other=0.0)
        # Rounded to the residual stream's dtype, as PyTorch's add rounds; the norm reads it so.
        total = (x + residual.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + rows * stride_ro + cols[None, :], total, mask=mask)
        x = total.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    normed = (x * inv_rms[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * stride_o + cols[None, :], weight[None, :] * normed, mask=mask)


@triton.jit(do_not_specialize=["num_rows", "n_cols"])
def _silu_and_mul_kernel(
    gate_ptr, up_ptr, out_ptr,
    num_rows, n_cols,
    stride_g, stride_u, stride_o,
    ROW_TILE: tl.constexpr, COL_TILE: tl.constexpr,
):
    """A [ROW_TILE, COL_TILE] tile of `silu(gate) * up`."""
    rows = tl.program_id(0) * ROW_TILE + tl.arange(0, ROW_TILE)
    cols = tl.program_id(1) * COL_TILE + tl.arange(0, COL_TILE)
    mask = (rows < num_rows)[:, None] & (cols < n_cols)[None, :]
    rows = rows.to(tl.int64)[:, None]
    gate = tl.load(gate_ptr + rows * stride_g + cols[None, :], mask=mask, other=0.0)
    up = tl.load(up_ptr + rows * stride_u + cols[None, :], mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # F.silu's rounding
    tl.store(out_ptr + rows * stride_o + cols[None, :], silu * up.to(tl.float32), mask=mask)


# --- entry points ----------------------------------------------------------------------------


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, out: Tensor | None = None) -> Tensor:
    """`weight * (xf * rsqrt(mean(xf^2) + eps)).to(x.dtype)` over the last dimension, xf = x in
    float32 (Hugging Face's LlamaRMSNorm) -> a tensor of x's shape in the dtype PyTorch's
    product gives (`torch.promote_types(weight.dtype, x.dtype)`), or written into `out`.

    Raises `ValueError` on inconsistent arguments (shapes, dtypes, devices, a last dimension
    that is not contiguous, or wider than `MAX_NORM_WIDTH`).
    """
    out = _norm_output(x, weight, out, "out")
    run_launches(rms_norm_launches(x, None, weight, eps, out, None))
    return out


def fused_add_rms_norm(
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    eps: float,
    *,
    out: Tensor | None = None,
    residual_out: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """A pre-norm block's residual add and the norm after it, in one launch ->
    `(rms_norm(x + residual), x + residual)`.

    The sum is rounded to `residual`'s dtype, as PyTorch's add rounds, and normalised as
    `rms_norm` does. `out` and `residual_out` receive the two results (new tensors when None);
    `out=x, residual_out=residual` computes in place.
    """
    _check_alike("residual must match x", residual, x)
    out = _norm_output(x, weight, out, "out")
    if residual_out is None:
        residual_out = torch.empty_like(x)
    check_output("residual_out", residual_out, x, x.dtype)
    run_launches(rms_norm_launches(x, residual, weight, eps, out, residual_out))
    return out, residual_out


def silu_and_mul(gate_up: Tensor, *, out: Tensor | None = None) -> Tensor:
    """SwiGLU's activation on a fused gate/up projection: gate_up [..., 2I] -> silu(gate) * up
    [..., I], the gate being the first half (vLLM's `SiluAndMul`)."""
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dimension must be even, got {tuple(gate_up.shape)}")
    half = gate_up.shape[-1] // 2
    return silu_mul(gate_up[..., :half], gate_up[..., half:], out=out)


def silu_mul(gate: Tensor, up: Tensor, *, out: Tensor | None = None) -> Tensor:
    """`F.silu(gate) * up`, rounded as PyTorch rounds, in one launch -> a tensor like `gate`
    (or `out`). `gate` and `up` may be views with strided rows (halves of one projection)."""
    _check_alike("gate and up must match", gate, up)
    _check_dtype("gate", gate.dtype)
    if out is None:
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    check_output("out", out, gate, gate.dtype)
    run_launches(silu_mul_launches(gate, up, out))
    return out


# --- launches --------------------------------------------------------------------------------


def rms_norm_launches(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, out: Tensor,
    residual_out: Tensor | None,
) -> list[KernelLaunch]:
    """The one launch of `rms_norm` (`residual` None) or `fused_add_rms_norm`; none for no rows.

    Works on meta tensors too, which is how `minipaged.kernels.triton.aot` compiles it.
    """
    x2, out2 = _rows(x, "x"), _rows(out, "out")
    num_rows, n = x2.shape
    if num_rows == 0:
        return []
    n_pad = pow2_at_least(n)
    row_tile = min(max(tile_elements() // n_pad, 1), pow2_at_least(num_rows))
    add = residual is not None
    r2 = _rows(residual, "residual") if add else x2
    ro2 = _rows(residual_out, "residual_out") if add else out2
    return [KernelLaunch(
        "add_rms_norm" if add else "rms_norm", _rms_norm_kernel,
        (triton.cdiv(num_rows, row_tile),),
        (x2, r2, weight, out2, ro2, num_rows, n, float(eps),
         x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0)),
        dict(N_PAD=n_pad, ROW_TILE=row_tile, ADD=add),
        # A whole row per program: more warps for wider rows, about 16 elements a thread.
        num_warps=min(max(row_tile * n_pad // 512, 1), 16),
    )]


def silu_mul_launches(gate: Tensor, up: Tensor, out: Tensor) -> list[KernelLaunch]:
    """The one launch of `silu_mul` (none for an empty input), on checked arguments."""
    g2, u2, o2 = _rows(gate, "gate"), _rows(up, "up"), _rows(out, "out")
    num_rows, n = g2.shape
    if num_rows == 0 or n == 0:
        return []
    col_tile = min(pow2_at_least(n), 1024)
    row_tile = min(max(tile_elements() // col_tile, 1), pow2_at_least(num_rows))
    return [KernelLaunch(
        "silu_and_mul", _silu_and_mul_kernel,
        (triton.cdiv(num_rows, row_tile), triton.cdiv(n, col_tile)),
        (g2, u2, o2, num_rows, n, g2.stride(0), u2.stride(0), o2.stride(0)),
        dict(ROW_TILE=row_tile, COL_TILE=col_tile),
        num_warps=min(max(row_tile * col_tile // 512, 1), 8),  # about 16 elements a thread
    )]


# --- checks ----------------------------------------------------------------------------------


def _check_dtype(name: str, dtype: torch.dtype) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {dtype}")


def _check_alike(what: str, a: Tensor, b: Tensor) -> None:
    """Raise `ValueError` ("`what`: got a's ... and b's ...") unless `a` and `b` share shape,
    dtype and device."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        raise ValueError(f"{what}: got {tuple(a.shape)} {a.dtype} on {a.device} and "
                         f"{tuple(b.shape)} {b.dtype} on {b.device}")


def _norm_output(x: Tensor, weight: Tensor, out: Tensor | None, name: str) -> Tensor:
    """`out`, checked, or a new tensor for the norm of `x`; the norm's arguments checked."""
    _check_dtype("x", x.dtype)
    _check_dtype("weight", weight.dtype)
    if x.dim() < 1 or weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1] if x.dim() else '?'}] (x's last "
                         f"dimension), got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    if weight.stride(0) != 1:
        raise ValueError("weight must be contiguous")
    if x.shape[-1] > MAX_NORM_WIDTH:
        raise ValueError(f"rows wider than {MAX_NORM_WIDTH} are not supported, got {x.shape[-1]}")
    dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        return torch.empty(x.shape, dtype=dtype, device=x.device)
    check_output(name, out, x, dtype)
    return out


def _rows(t: Tensor, name: str) -> Tensor:
    """`t` as a [rows, last dim] view with unit stride along the row (no copy: outputs are
    written through it). Raises `ValueError` when no such view exists."""
    if t.dim() == 0 or (t.shape[-1] > 1 and t.stride(-1) != 1):
        raise ValueError(f"{name} must have a contiguous last dimension")
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError as error:
        raise ValueError(f"{name}'s rows must be evenly strided ({error})") from None
