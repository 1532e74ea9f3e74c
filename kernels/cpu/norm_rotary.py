"""RMSNorm, rotary embeddings and SwiGLU's SiLU-and-multiply in one C call each
(`csrc/norm_rotary.c`), and the row look-up a replayed step starts with (`bind_gather_rows`) and
the widening of its bfloat16 logits it ends with (`bind_to_float32`).

In PyTorch an RMSNorm is eight operators (a cast, a square, a mean, an add, a reciprocal square
root, two products, a cast back), a rotary six per tensor (two products, a half swap with a
negation and a concatenation, a sum) and SwiGLU's activation two. At the one row of a request's
decode step each operator costs a few microseconds to dispatch and almost nothing to compute; a
step of SmolLM2 runs 61 norms, 60 rotaries and 30 SwiGLUs. Here each is one pass over its rows,
rounding as PyTorch rounds (`minipaged.models.layers` computes the same in PyTorch and calls
these where they apply). `bind_add_rms_norm` also folds the residual add before a norm into it,
for a replayed step (`minipaged.platforms.cpu.replay`).

`norm_rotary_available()` says whether the kernels could be built (`build_native`); without a
compiler the models keep their PyTorch code.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from minipaged.kernels.cpu.build import F32, I32, I64, POINTER, native_loader
from minipaged.kernels.cpu.calls import ENTRY, KernelCall, require_native

SOURCE = Path(__file__).with_name("csrc") / "norm_rotary.c"
DTYPES = (torch.float32, torch.bfloat16)  # what the kernels read and write
NORM_PROFILER_NAME = "minipaged::rms_norm"
ROTARY_PROFILER_NAME = "minipaged::rotary"
SILU_MUL_PROFILER_NAME = "minipaged::silu_mul"


class RmsNormArgs(ctypes.Structure):
    """`rms_norm_args` of `csrc/norm_rotary.c`, field for field (as the three below)."""

    _fields_ = [("x", POINTER), ("weight", POINTER), ("out", POINTER), ("rows", I64),
                ("n", I64), ("eps", F32), ("bf16", I32)]


class AddRmsNormArgs(ctypes.Structure):
    _fields_ = [("x", POINTER), ("residual", POINTER), ("weight", POINTER), ("out", POINTER),
                ("rows", I64), ("n", I64), ("eps", F32), ("bf16", I32)]


class RotaryArgs(ctypes.Structure):
    _fields_ = [("x", POINTER), ("row_stride", I64), ("cos", POINTER), ("sin", POINTER),
                ("out", POINTER), ("rows", I64), ("heads", I64), ("d", I64), ("bf16", I32)]


class SiluMulArgs(ctypes.Structure):
    _fields_ = [("gate", POINTER), ("up", POINTER), ("row_stride", I64), ("out", POINTER),
                ("rows", I64), ("n", I64), ("bf16", I32)]


class GatherRowsArgs(ctypes.Structure):
    _fields_ = [("table", POINTER), ("table_rows", I64), ("row_bytes", I64), ("index", POINTER),
                ("n", I64), ("out", POINTER)]


class ToFloat32Args(ctypes.Structure):
    _fields_ = [("x", POINTER), ("out", POINTER), ("n", I64)]


# The kernels, built and loaded once per process (`native_loader`); None without.
_library = native_loader(SOURCE, {name: ENTRY for name in (
    "rms_norm_call", "add_rms_norm_call", "rotary_call", "silu_mul_call", "gather_rows_call",
    "to_float32_call")})


def norm_rotary_available() -> bool:
    """Whether the kernels are built and loaded in this process (building them if need be)."""
    return _library() is not None


def _takes(*tensors: Tensor) -> bool:
    """CPU tensors of one of `DTYPES`, all of one dtype, nothing to differentiate."""
    dtype = tensors[0].dtype
    return (
        dtype in DTYPES
        and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
        and norm_rotary_available()
    )


def rms_norm_supports(x: Tensor, weight: Tensor) -> bool:
    """Whether `rms_norm` takes `x` (contiguous, normalised over its last dimension) and
    `weight` (contiguous, of x's last size): CPU tensors of one of `DTYPES`, x's dtype,
    nothing to differentiate, and the kernel built."""
    return (
        x.dim() >= 1 and weight.dim() == 1 and weight.shape[0] == x.shape[-1]
        and x.is_contiguous() and weight.is_contiguous() and _takes(x, weight)
    )


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`weight * (x / sqrt(mean(x^2) + eps))` over x's last dimension, as a new tensor: the
    statistics in float32, the normalised value rounded to x's dtype, then multiplied by the
    weight (as `minipaged.models.layers.RMSNorm` computes it). Arguments as
    `rms_norm_supports` takes them."""
    out = torch.empty_like(x)
    bind_rms_norm(x, weight, eps, out).run_as(NORM_PROFILER_NAME)
    return out


def bind_rms_norm(x: Tensor, weight: Tensor, eps: float, out: Tensor) -> KernelCall:
    """`out = rms_norm(x, weight, eps)` as a call with every argument fixed, to run again and
    again over the same tensors (their contents changing: a step replayed). `out` is
    contiguous, of x's shape and dtype (it may be x)."""
    library = require_native(_library(), "norm kernel")
    if not (out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {tuple(x.shape)} {x.dtype}")
    n = x.shape[-1]
    return KernelCall(library.rms_norm_call, RmsNormArgs(
        x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // n, n, eps,
        int(x.dtype == torch.bfloat16)))


def bind_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                      out: Tensor) -> KernelCall:
    """`x += residual; out = rms_norm(x, weight, eps)` as one call with every argument fixed
    (a layer's residual add and the norm after it, replayed). x, residual and out contiguous,
    of one shape and dtype, out not x."""
    library = require_native(_library(), "norm kernel")
    if not all(t.shape == x.shape and t.dtype == x.dtype and t.is_contiguous()
               for t in (x, residual, out)) or out.data_ptr() == x.data_ptr():
        raise ValueError(f"x, residual and out must be contiguous {tuple(x.shape)} {x.dtype}, "
                         "out not x")
    n = x.shape[-1]
    return KernelCall(library.add_rms_norm_call, AddRmsNormArgs(
        x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // n,
        n, eps, int(x.dtype == torch.bfloat16)))


def rotary_supports(x: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether `rotary` takes `x [T, heads, D]` (each row's heads side by side: strides
    `(any, D, 1)`) with `cos`, `sin` (`[T, 1, D]` or `[T, D]`, contiguous): CPU tensors of
    one of `DTYPES`, x's dtype, nothing to differentiate, and the kernel built."""
    tokens, _, head_dim = x.shape if x.dim() == 3 else (None, None, None)
    return (
        tokens is not None and head_dim % 2 == 0
        and x.stride(1) == head_dim and x.stride(2) == 1
        and all(t.is_contiguous() and t.numel() == tokens * head_dim
                and t.shape[-1] == head_dim for t in (cos, sin))
        and _takes(x, cos, sin)
    )


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """`x * cos + rotate_half(x) * sin` (`minipaged.models.layers.apply_rotary`) as a new
    contiguous `[T, heads, D]`: each pair (i, i + D/2) of every head of token t turned by the
    angle of `cos[t, i]`, `sin[t, i]`, each product and the sum rounded to x's dtype.
    Arguments as `rotary_supports` takes them."""
    out = torch.empty(x.shape, dtype=x.dtype)
    bind_rotary(x, cos, sin, out).run_as(ROTARY_PROFILER_NAME)
    return out


def bind_rotary(x: Tensor, cos: Tensor, sin: Tensor, out: Tensor) -> KernelCall:
    """`out = rotary(x, cos, sin)` as a call with every argument fixed, to run again and again
    over the same tensors (their contents changing: a step replayed). `out` is a contiguous
    `[T, heads, D]` of x's dtype."""
    library = require_native(_library(), "rotary kernel")
    if not (out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {tuple(x.shape)} {x.dtype}")
    tokens, heads, head_dim = x.shape
    return KernelCall(library.rotary_call, RotaryArgs(
        x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), tokens,
        heads, head_dim, int(x.dtype == torch.bfloat16)))


def silu_mul_supports(gate: Tensor, up: Tensor) -> bool:
    """Whether `silu_mul` takes `gate` and `up`: `[T, n]` each, rows equally far apart and
    each row contiguous (the two halves of a fused projection's output, say), CPU tensors of
    one of `DTYPES`, one dtype, nothing to differentiate, and the kernel built."""
    return (
        gate.dim() == 2 and up.shape == gate.shape and gate.stride(1) == up.stride(1) == 1
        and gate.stride(0) == up.stride(0) and _takes(gate, up)
    )


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """`F.silu(gate) * up` as a new contiguous `[T, n]`, the SiLU and the product each rounded
    to the inputs' dtype. Arguments as `silu_mul_supports` takes them."""
    out = torch.empty(gate.shape, dtype=gate.dtype)
    bind_silu_mul(gate, up, out).run_as(SILU_MUL_PROFILER_NAME)
    return out


def bind_silu_mul(gate: Tensor, up: Tensor, out: Tensor) -> KernelCall:
    """`out = silu_mul(gate, up)` as a call with every argument fixed, to run again and again
    over the same tensors (a step replayed). `out` is a contiguous `[T, n]` of gate's dtype,
    in memory of its own."""
    library = require_native(_library(), "SiLU kernel")
    if not (out.shape == gate.shape and out.dtype == gate.dtype and out.is_contiguous()
            and not _overlap(out, gate) and not _overlap(out, up)):
        raise ValueError(f"out must be a contiguous {tuple(gate.shape)} {gate.dtype} apart "
                         "from gate and up")
    rows, n = gate.shape
    return KernelCall(library.silu_mul_call, SiluMulArgs(
        gate.data_ptr(), up.data_ptr(), gate.stride(0), out.data_ptr(), rows, n,
        int(gate.dtype == torch.bfloat16)))


def bind_gather_rows(table: Tensor, index: Tensor, out: Tensor) -> KernelCall:
    """`out[i] = table[index[i]]` (an embedding look-up: `F.embedding(index, table)`) as a call
    with every argument fixed, to run again and again over the same tensors (a step replayed).
    `table [rows, n]` and `out [len(index), n]` contiguous, one dtype; `index` contiguous int64.
    The call refuses (status -1, writing nothing) an index outside the table."""
    library = require_native(_library(), "row look-up")
    if (table.dim() != 2 or not table.is_contiguous() or index.dtype != torch.int64
            or index.dim() != 1 or not index.is_contiguous()):
        raise ValueError(f"table must be a contiguous 2-D tensor and index a contiguous int64 "
                         f"vector, got {tuple(table.shape)} and {index.dtype} "
                         f"{tuple(index.shape)}")
    if not (out.shape == (index.shape[0], table.shape[1]) and out.dtype == table.dtype
            and out.is_contiguous()):
        raise ValueError(f"out must be a contiguous [{index.shape[0]}, {table.shape[1]}] "
                         f"{table.dtype}")
    return KernelCall(library.gather_rows_call, GatherRowsArgs(
        table.data_ptr(), table.shape[0], table.shape[1] * table.element_size(),
        index.data_ptr(), index.shape[0], out.data_ptr()))


def bind_to_float32(x: Tensor, out: Tensor) -> KernelCall:
    """`out = x.float()` for a contiguous bfloat16 `x` into a contiguous float32 `out` of its
    shape (exact), as a call with every argument fixed (a replayed step's logits)."""
    library = require_native(_library(), "widening")
    if not (x.dtype == torch.bfloat16 and x.is_contiguous() and out.dtype == torch.float32
            and out.shape == x.shape and out.is_contiguous()):
        raise ValueError(f"x must be contiguous bfloat16 and out contiguous float32 of its "
                         f"shape, got {x.dtype} {tuple(x.shape)} and {out.dtype} "
                         f"{tuple(out.shape)}")
    return KernelCall(library.to_float32_call, ToFloat32Args(x.data_ptr(), out.data_ptr(),
                                                             x.numel()))


def _overlap(a: Tensor, b: Tensor) -> bool:
    """Whether the bytes two tensors' elements span meet."""
    (a_start, a_end), (b_start, b_end) = _extent(a), _extent(b)
    return a_start < b_end and b_start < a_end


def _extent(t: Tensor) -> tuple[int, int]:
    """The bytes from a tensor's first element to past its last."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
