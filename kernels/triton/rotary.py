"""Rotary position embedding of the step's queries and keys, fused with the K/V cache write.

After the QKV projection an attention layer rotates q and k by their tokens' positions
(RoFormer, Su et al.) and writes k and v into their paged-cache slots (`reshape_and_cache`).
In PyTorch the rotary alone is six operators per tensor (two products, a half swap with a
negation and a concatenation, a sum) plus the cos/sin gathers; here the rotary and the cache
write are one launch that reads q, k and v once.

Rotary layout: Hugging Face's `rotate_half`, dimension i paired with i + D/2 and both rotated by
the angle of pair i: `x * cos + rotate_half(x) * sin` (`minipaged.models.layers.RotaryEmbedding`).
The rotation is computed in float32 from float32 cos/sin and rounded once to the dtype (PyTorch,
with cos/sin cast to the dtype, rounds after each operator: the results may differ by an ulp).

Program: a tile of tokens, each with all its query and KV heads. The grid comes from shapes
only and nothing is read back on the host, so the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from minipaged.attention.contract import check_index_tensor, check_reshape_and_cache_args

from .launch import KernelLaunch, check_output, pow2_at_least, run_launches, token_tile


@triton.jit
def _load_halves(ptr, rows, cols, mask, stride_d, HALF: tl.constexpr):
    """The two halves (dims i and i + HALF) at row offsets `rows`, in float32."""
    x1 = tl.load(ptr + rows + cols * stride_d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + rows + (cols + HALF) * stride_d, mask=mask, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _store_halves(ptr, rows, cols, mask, stride_d, x1, x2, HALF: tl.constexpr):
    tl.store(ptr + rows + cols * stride_d, x1, mask=mask)
    tl.store(ptr + rows + (cols + HALF) * stride_d, x2, mask=mask)


# One compiled program for every batch size (Triton would specialise 1 and multiples of 16).
@triton.jit(do_not_specialize=["num_tokens"])
def _rotary_and_cache_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, positions_ptr, k_cache_ptr, v_cache_ptr,
    slot_mapping_ptr, q_out_ptr, k_out_ptr,
    num_tokens,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cos, stride_sin,
    stride_qot, stride_qoh, stride_qod,
    stride_kot, stride_koh, stride_kod,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TOKEN_TILE: tl.constexpr, WRITE_K: tl.constexpr,
):
    """Rotate TOKEN_TILE tokens' q (into q_out) and k; write k and v to their slots (not for
    slot -1) and, with WRITE_K, the rotated k to k_out."""
    tokens = tl.program_id(0) * TOKEN_TILE + tl.arange(0, TOKEN_TILE)
    token_ok = tokens < num_tokens
    cols = tl.arange(0, HALF_PAD)
    col_ok = cols < HALF
    position = tl.load(positions_ptr + tokens, mask=token_ok, other=0).to(tl.int64)
    angle_mask = token_ok[:, None] & col_ok[None, :]
    cos = tl.load(cos_ptr + position[:, None] * stride_cos + cols[None, :], mask=angle_mask,
                  other=0.0).to(tl.float32)[:, None, :]
    sin = tl.load(sin_ptr + position[:, None] * stride_sin + cols[None, :], mask=angle_mask,
                  other=0.0).to(tl.float32)[:, None, :]
    # [tokens, heads, half dims] index grids.
    t3 = tokens.to(tl.int64)[:, None, None]
    c3 = cols[None, None, :]

    heads = tl.arange(0, HEADS_PAD)[None, :, None]
    mask = token_ok[:, None, None] & (heads < NUM_HEADS) & col_ok[None, None, :]
    x1, x2 = _load_halves(q_ptr, t3 * stride_qt + heads * stride_qh, c3, mask, stride_qd, HALF)
    _store_halves(q_out_ptr, t3 * stride_qot + heads * stride_qoh, c3, mask, stride_qod,
                  x1 * cos - x2 * sin, x2 * cos + x1 * sin, HALF)

    heads = tl.arange(0, KV_HEADS_PAD)[None, :, None]
    mask = token_ok[:, None, None] & (heads < NUM_KV_HEADS) & col_ok[None, None, :]
    x1, x2 = _load_halves(k_ptr, t3 * stride_kt + heads * stride_kh, c3, mask, stride_kd, HALF)
    k1 = x1 * cos - x2 * sin
    k2 = x2 * cos + x1 * sin
    if WRITE_K:
        _store_halves(k_out_ptr, t3 * stride_kot + heads * stride_koh, c3, mask, stride_kod,
                      k1, k2, HALF)
    v1 = tl.load(v_ptr + t3 * stride_vt + heads * stride_vh + c3 * stride_vd, mask=mask)
    v2 = tl.load(v_ptr + t3 * stride_vt + heads * stride_vh + (c3 + HALF) * stride_vd, mask=mask)

    # The cache write (`reshape_and_cache`): slot = block * BLOCK_SIZE + offset, -1 = skip.
    slot = tl.load(slot_mapping_ptr + tokens, mask=token_ok, other=-1).to(tl.int64)
    write = slot >= 0
    block = (tl.where(write, slot, 0) // BLOCK_SIZE)[:, None, None]
    offset = (tl.where(write, slot, 0) % BLOCK_SIZE)[:, None, None]
    mask = mask & write[:, None, None]
    _store_halves(k_cache_ptr, block * stride_kcb + offset * stride_kcs + heads * stride_kch,
                  c3, mask, stride_kcd, k1, k2, HALF)
    _store_halves(v_cache_ptr, block * stride_vcb + offset * stride_vcs + heads * stride_vch,
                  c3, mask, stride_vcd, v1, v2, HALF)


def rotary_and_cache(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    *,
    q_out: Tensor | None = None,
    k_out: Tensor | None = None,
    validate: bool = True,
) -> Tensor:
    """Rotate q [T, H, D] and k [T, H_kv, D] by `positions` [T]; write the rotated k and v
    [T, H_kv, D] into slot `slot_mapping[t]` of k_cache / v_cache [num_blocks, block_size,
    H_kv, D] (-1: skip the token) -> the rotated q.

    `cos`, `sin`: [P, D] (the model's tables, each angle twice) or [P, D/2], any float dtype;
    only their first D/2 columns are read. The rotated q goes to `q_out`, by default q itself
    (in place, as vLLM's rotary does); the rotated k goes to the cache, and to `k_out` too when
    given (`k_out=k`: in place). q, k and v may be strided views (slices of one QKV projection).
    Raises `ValueError` on inconsistent arguments; `validate=False` skips the checks that read
    the tensors back on the host (slot and position ranges), as a captured step must.
    """
    _check_rotary_args(q, k, v, cos, sin, positions)
    if validate:
        check_reshape_and_cache_args(k, v, k_cache, v_cache, slot_mapping)
        if positions.numel() and bool(((positions < 0) | (positions >= cos.shape[0])).any()):
            raise ValueError(f"positions must lie in 0..{cos.shape[0] - 1}")
    if q_out is None:
        q_out = q
    for name, out, like in (("q_out", q_out, q), ("k_out", k_out, k)):
        if out is not None:
            check_output(name, out, like, like.dtype)
    run_launches(rotary_and_cache_launches(q, k, v, cos, sin, positions, k_cache, v_cache,
                                           slot_mapping, q_out, k_out))
    return q_out


def rotary_and_cache_launches(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, positions: Tensor,
    k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, q_out: Tensor,
    k_out: Tensor | None,
) -> list[KernelLaunch]:
    """The one launch of `rotary_and_cache` (none for no tokens), on checked arguments.

    Works on meta tensors too, which is how `minipaged.kernels.triton.aot` compiles it.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return []
    half = head_dim // 2
    heads_pad, kv_heads_pad = pow2_at_least(num_heads), pow2_at_least(num_kv_heads)
    half_pad = pow2_at_least(half)
    per_token = 2 * (heads_pad + kv_heads_pad) * half_pad
    tile = token_tile(per_token, num_tokens)
    write_k = k_out is not None
    k_out = k_out if write_k else k  # an unused pointer argument
    return [KernelLaunch(
        "rotary_and_cache", _rotary_and_cache_kernel, (triton.cdiv(num_tokens, tile),),
        (q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping, q_out, k_out,
         num_tokens, *q.stride(), *k.stride(), *v.stride(), cos.stride(0), sin.stride(0),
         *q_out.stride(), *k_out.stride(), *k_cache.stride(), *v_cache.stride()),
        dict(NUM_HEADS=num_heads, HEADS_PAD=heads_pad,
             NUM_KV_HEADS=num_kv_heads, KV_HEADS_PAD=kv_heads_pad,
             HALF=half, HALF_PAD=half_pad,
             BLOCK_SIZE=k_cache.shape[1], TOKEN_TILE=tile, WRITE_K=write_k),
        # About 16 elements of each tile a thread (wide layers hold more than 4K a token).
        num_warps=min(max(pow2_at_least(tile * per_token // 1024), 4), 16),
    )]


def _check_rotary_args(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor,
                       positions: Tensor) -> None:
    """The checks that need no host read: shapes, dtypes, devices."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q must be [T, H, D] and k [T, H_kv, D], got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must be shaped like k {tuple(k.shape)}, got {tuple(v.shape)}")
    head_dim = q.shape[2]
    if head_dim % 2:
        raise ValueError(f"the head dim must be even (rotated in pairs), got {head_dim}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or len(
            {q.dtype, k.dtype, v.dtype}) != 1:
        raise ValueError(f"q, k and v must share one of float32, float16, bfloat16: got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if (cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] not in (head_dim, head_dim // 2)
            or not cos.is_floating_point() or cos.dtype != sin.dtype):
        raise ValueError(f"cos and sin must both be [P, {head_dim}] or [P, {head_dim // 2}] "
                         f"floats, got {tuple(cos.shape)} {cos.dtype} and {tuple(sin.shape)} "
                         f"{sin.dtype}")
    if cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError("cos and sin must have contiguous rows")
    check_index_tensor("positions", positions)
    if positions.shape != (q.shape[0],):
        raise ValueError(f"positions must be [{q.shape[0]}], got {tuple(positions.shape)}")
    for name, t in (("k", k), ("v", v), ("cos", cos), ("sin", sin), ("positions", positions)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
