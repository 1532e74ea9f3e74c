"""Device-side pieces shared by the attention kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    k_cache_ptr, v_cache_ptr, block_table_row_ptr, keys, key_ok, kv_head, dims, dim_ok,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    BLOCK_SIZE: tl.constexpr,
):
    """Keys and values [KEY_TILE, HEAD_DIM_PAD] of context positions `keys`, as float32.

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
    ).to(tl.float32)
    v = tl.load(
        v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vs
        + kv_head * stride_vh + dims[None, :] * stride_vd,
        mask=mask, other=0.0,
    ).to(tl.float32)
    return k, v
