"""Device-side pieces shared by the attention kernels: the paged K/V read and the two products.

Precision. Both products accumulate in float32 and are as exact as float32 arithmetic, whatever
the cache dtype; how they get there is chosen per dtype so that the tensor cores see the
narrowest operands that keep that promise (registers are what the kernels run short of):

* float16 / bfloat16 caches: Q.K^T multiplies the stored 16-bit values directly (a product of
  two 16-bit values is exact in float32). The float32 probabilities P are split into two
  16-bit parts, P = hi + lo, and P.V is two 16-bit products: hi.V + lo.V is P.V to within
  2^-22 (float16) or 2^-16 (bfloat16) of each probability, far below one rounding of the output.
* float32 caches: both products in "tf32x3" (three TF32 products that recover float32).

The prefill kernel, bound by its products rather than by memory, takes Q.K^T and the float32
path from here but rounds P to the 16-bit cache dtype for one P.V product, as FlashAttention
does (`prefill.py`).

Triton's interpreter cannot multiply bfloat16, so there (`UPCAST`) the same
16-bit values are widened to float32 just before each product: same values, same products, so
the CPU tests check the arithmetic a GPU runs.
"""

from __future__ import annotations

import triton
import triton.language as tl

# `tl.dot` precision for float32 operands; 16-bit operands are multiplied exactly anyway.
FP32_DOT_PRECISION: tl.constexpr = tl.constexpr("tf32x3")


@triton.jit
def load_kv_tile(
    k_cache_ptr, v_cache_ptr, block_table_row_ptr, keys, key_ok, kv_head, dims, dim_ok,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    BLOCK_SIZE: tl.constexpr,
):
    """Keys and values [KEY_TILE, HEAD_DIM_PAD] of context positions `keys`, in the cache dtype.

    Each position's physical block comes from the sequence's block table (the PagedAttention
    indirection, vLLM paper section 4.1), then its slot inside that block. Masked positions and
    padded dimensions read as 0.
    """
    block = tl.load(block_table_row_ptr + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    offset = keys % BLOCK_SIZE
    mask = key_ok[:, None] & dim_ok[None, :]
    k = tl.load(
        k_cache_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ks
        + kv_head * stride_kh + dims[None, :] * stride_kd,
        mask=mask, other=0.0,
    )
    v = tl.load(
        v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vs
        + kv_head * stride_vh + dims[None, :] * stride_vd,
        mask=mask, other=0.0,
    )
    return k, v


@triton.jit
def operand(x, UPCAST: tl.constexpr):
    """`x` as a `tl.dot` operand: itself on a GPU, widened to float32 in the interpreter."""
    if UPCAST:
        return x.to(tl.float32)
    return x


@triton.jit
def qk_scores(q, k, scale, UPCAST: tl.constexpr):
    """scale * Q.K^T in float32: q [rows, D] and k [keys, D] in the cache dtype."""
    return tl.dot(operand(q, UPCAST), tl.trans(operand(k, UPCAST)),
                  input_precision=FP32_DOT_PRECISION) * scale


@triton.jit
def pv_accumulate(acc, p, v, UPCAST: tl.constexpr):
    """acc + P.V in float32: p [rows, keys] float32, v [keys, D] in the cache dtype."""
    if v.dtype == tl.float32:
        return tl.dot(p, v, acc, input_precision=FP32_DOT_PRECISION)
    hi = p.to(v.dtype)
    lo = (p - hi.to(tl.float32)).to(v.dtype)
    v = operand(v, UPCAST)
    return tl.dot(operand(lo, UPCAST), v, tl.dot(operand(hi, UPCAST), v, acc))
